"""lab.predict_stream: per-batch predictions through the model's own predict_step."""

import gc
import itertools
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab
from lab.backend.tensorflow.predict import predict_function


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(100, 4)).astype("float32")


def test_arrays_give_model_predict_values_batch_by_batch(model, x):
    expected = model.predict(x, batch_size=32, verbose=0)
    batches = list(lab.predict_stream(model, x, batch_size=32))
    assert [len(b) for b in batches] == [32, 32, 32, 4]
    np.testing.assert_allclose(np.concatenate(batches), expected, rtol=1e-6, atol=1e-7)


def test_a_dataset_with_labels_feeds_a_running_accuracy(model, x):
    y = np.arange(100) % 3
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    hits = {"right": 0, "seen": 0}

    def collect(y_pred, batch):
        _, labels = batch
        hits["right"] += int((y_pred.argmax(-1) == labels.numpy()).sum())
        hits["seen"] += len(labels)

    assert lab.predict_stream(model, dataset, collect=collect) == 100
    full = model.predict(x, verbose=0).argmax(-1)
    assert hits == {"right": int((full == y).sum()), "seen": 100}


def test_a_generator_of_batches_and_an_endless_one_with_steps(model, x):
    def batches():
        for start in range(0, 100, 25):
            yield x[start:start + 25]

    streamed = np.concatenate(list(lab.predict_stream(model, batches())))
    np.testing.assert_allclose(streamed, model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    endless = (x[:10] for _ in itertools.count())
    assert len(list(lab.predict_stream(model, endless, steps=3))) == 3


def test_a_pydataset_is_read_batch_by_batch(model, x):
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, index):
            return x[index * 20:(index + 1) * 20], np.zeros(20)

    streamed = np.concatenate(list(lab.predict_stream(model, Batches())))
    np.testing.assert_allclose(streamed, model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)


def test_a_pydataset_batch_is_made_once_and_an_endless_one_runs_with_steps(model, x):
    # Each batch was made twice (once to predict, once for collect): a
    # PyDataset that augments at random handed collect another batch than the
    # one predicted. One that says `num_batches` is None (endless), as Keras
    # documents, failed on len().
    class Augmented(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.made, self.rng = 0, np.random.default_rng(2)

        @property
        def num_batches(self):
            return None

        def __getitem__(self, index):
            self.made += 1
            start = index % 5 * 20
            return x[start:start + 20] + self.rng.normal(size=(20, 4)).astype("float32")

    data, pairs = Augmented(), []
    assert lab.predict_stream(model, data, steps=3, collect=lambda y_pred, batch: pairs.append((y_pred, batch))) == 60
    assert data.made == 3
    for y_pred, batch in pairs:
        np.testing.assert_allclose(y_pred, model.predict_on_batch(batch), rtol=1e-6, atol=1e-7)


def test_a_pydataset_is_read_between_its_epoch_hooks_as_predict_reads_it(model, x):
    # model.predict calls on_epoch_begin before the batches and on_epoch_end
    # after them; predict_stream called neither, so a PyDataset that readies
    # or winds up a pass there (reseeds its augmentation, closes a file) was
    # read otherwise than predict reads it.
    class Counted(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.hooks = []

        def __len__(self):
            return 5

        def on_epoch_begin(self):
            self.hooks.append("begin")

        def on_epoch_end(self):
            self.hooks.append("end")

        def __getitem__(self, index):
            return x[index * 20:(index + 1) * 20]

    predicted, streamed = Counted(), Counted()
    expected = model.predict(predicted, verbose=0)
    np.testing.assert_allclose(np.concatenate(list(lab.predict_stream(model, streamed))), expected,
                               rtol=1e-6, atol=1e-7)
    assert streamed.hooks == predicted.hooks == ["begin", "end"]
    model.predict(predicted, steps=2, verbose=0)
    assert len(list(lab.predict_stream(model, streamed, steps=2))) == 2
    assert streamed.hooks == predicted.hooks

def test_multi_input_models_take_a_list_or_dict_of_arrays():
    a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    two = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    xa, xb = np.ones((10, 2), "float32"), np.ones((10, 3), "float32")
    expected = two.predict([xa, xb], verbose=0)
    as_list = np.concatenate(list(lab.predict_stream(two, [xa, xb], batch_size=4)))
    as_dict = np.concatenate(list(lab.predict_stream(two, {"a": xa, "b": xb}, batch_size=4)))
    np.testing.assert_allclose(as_list, expected, rtol=1e-6)
    np.testing.assert_allclose(as_dict, expected, rtol=1e-6)


def test_the_models_own_predict_step_is_called_and_outputs_keep_their_structure(x):
    class Scored(keras.Sequential):
        def predict_step(self, data):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            probabilities = self(x, training=False)
            return {"probabilities": probabilities, "label": tf.argmax(probabilities, -1)}

    scored = Scored([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    first = next(lab.predict_stream(scored, x, batch_size=10))
    assert set(first) == {"probabilities", "label"}
    assert first["probabilities"].shape == (10, 3)
    np.testing.assert_array_equal(first["label"], first["probabilities"].argmax(-1))


def test_one_traced_function_serves_every_batch_and_predict_is_never_called(x, monkeypatch):
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    monkeypatch.setattr(fresh, "predict", lambda *a, **k: pytest.fail("model.predict was called"))
    batches = list(lab.predict_stream(fresh, x, batch_size=10))
    assert len(batches) == 10
    function = predict_function(fresh)
    assert function.experimental_get_tracing_count() == 1
    list(lab.predict_stream(fresh, x, batch_size=10))
    assert predict_function(fresh) is function
    assert function.experimental_get_tracing_count() == 1
    # Keras' own cached predict function is left alone.
    assert fresh.predict_function is None


def test_an_eager_model_is_predicted_eagerly(x):
    eager = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    eager.compile(loss="mse", run_eagerly=True)
    seen = []

    class Spy(keras.layers.Layer):
        def call(self, inputs):
            seen.append(tf.executing_eagerly())
            return inputs

    eager.add(Spy())
    seen.clear()  # adding the layer called it symbolically
    list(lab.predict_stream(eager, x[:20], batch_size=10))
    assert seen == [True, True]


def test_the_stream_keeps_no_batch_it_has_handed_out(model, x):
    stream = lab.predict_stream(model, x, batch_size=10)
    handed = [weakref.ref(next(stream))]
    for y_pred in stream:
        handed.append(weakref.ref(y_pred))
        del y_pred
    gc.collect()
    assert all(ref() is None for ref in handed)


def test_bad_input_gets_a_clear_error(model, x):
    for argument, bad, error in (("batch_size", 0, ValueError), ("batch_size", 32.0, TypeError),
                                 ("steps", -1, ValueError), ("steps", 2.5, TypeError)):
        with pytest.raises(error, match=rf"lab.predict_stream\({argument}=\.\.\.\) must be .*\(e.g. "):
            lab.predict_stream(model, x, **{argument: bad})
    with pytest.raises(TypeError, match="cannot read data of type int"):
        lab.predict_stream(model, 3)
    with pytest.raises(TypeError, match="collect must be a callable"):
        lab.predict_stream(model, x, collect=[])
    with pytest.raises(TypeError, match="needs a keras.Model"):
        lab.predict_stream(lambda v: v, x)
    with pytest.raises(ValueError, match="same number of samples; got 3 and 2"):
        lab.predict_stream(model, [np.ones((3, 4)), np.ones((2, 4))])


class ScalesItsInputs(keras.Model):
    """A model whose predict_step computes with its inputs in their own float
    type: float64 inputs and float32 weights do not add."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.fed = []

    def call(self, x):
        return self.dense(x)

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        self.fed.append(x.dtype.name)
        return x[:, :1] / 3 + self.dense(x)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_float64_arrays_are_predicted_as_floatx_as_model_predict_casts_them(as_tensor):
    # predict_stream fed float64 slices on as float64; model.predict casts
    # float arrays to the backend's float type. The step above raised a
    # TypeError in predict_stream where model.predict worked.
    x = np.random.default_rng(4).normal(size=(10, 3))
    model = ScalesItsInputs()
    model(x[:1].astype("float32"))
    expected = model.predict(x, batch_size=4, verbose=0)
    data = tf.constant(x) if as_tensor else x
    got = np.concatenate(list(lab.predict_stream(model, data, batch_size=4)))
    assert model.fed[-1] == keras.backend.floatx()
    np.testing.assert_array_equal(got, expected)


def test_a_sparse_tensor_of_inputs_is_predicted_as_model_predict_predicts_it():
    # predict_stream refused it ("cannot read data of type SparseTensor"); model.predict takes it.
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,), sparse=True)
    sparse = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    dense = np.random.default_rng(5).normal(size=(50, 6)).astype("float32")
    x = tf.sparse.from_dense(np.where(np.abs(dense) > 0.8, dense, 0).astype("float32"))
    batches = list(lab.predict_stream(sparse, x, batch_size=16))
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    np.testing.assert_array_equal(np.concatenate(batches), sparse.predict(x, batch_size=16, verbose=0))
