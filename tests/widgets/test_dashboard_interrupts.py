"""widgets.Dashboard over an interrupted fit(): its status and its file say so, as its Recorder's do."""

import keras
import numpy as np
import pytest
from keras.src.backend.tensorflow import trainer

import lab
import widgets


def model_and_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(48, 4)).astype("float32"), rng.normal(size=(48, 1)).astype("float32")


@pytest.mark.parametrize("place", ["making the epoch's data iterator", "a data generator"])
def test_an_interrupt_in_keras_own_code_or_the_data_leaves_the_dashboard_interrupted(place, monkeypatch, tmp_path):
    model, x, y = model_and_data()
    dashboard = widgets.Dashboard(gradients=True, view="html", path=str(tmp_path / "run.h5"), flush_every=3600)
    statuses = []
    dashboard.recorder.add_status_listener(lambda status, detail: statuses.append(status))
    if place == "a data generator":
        def batches():
            for i in range(100):
                if i == 4:
                    raise KeyboardInterrupt
                yield x[:8], y[:8]

        with pytest.raises(Exception, match="KeyboardInterrupt"):  # TensorFlow's UnknownError, as without the lab
            model.fit(batches(), epochs=1, steps_per_epoch=8, verbose=0, callbacks=[dashboard])
        rows = 4
    else:
        made, calls = trainer.TFEpochIterator._get_iterator, []

        def interrupted_at_the_second_epoch(self):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return made(self)

        monkeypatch.setattr(trainer.TFEpochIterator, "_get_iterator", interrupted_at_the_second_epoch)
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[dashboard])
        rows = 6
    assert dashboard.status == "interrupted" and statuses[-1] == "interrupted"
    # (Through tf.data, Keras' optimizer also counts the step that found the
    # interrupt instead of a batch, with or without the lab: a row per batch trained.)
    assert len(dashboard.run) == rows == int(model.optimizer.iterations) - (place == "a data generator")
    assert dashboard.run.events()["kind"].tolist() == ["interrupt"]
    saved = lab.Run.load(tmp_path / "run.h5")
    assert len(saved) == rows and saved.metadata["status"] == "interrupted"
    assert not lab.hooks.attached(model)
