"""Fixtures for the views: a recording comm, a tiny model, the digits."""

import comm
import numpy as np
import pytest
from comm.base_comm import BaseComm


class RecordingComm(BaseComm):
    """A comm that keeps every message a widget sends instead of sending it."""

    kernel = "recording"  # ipywidgets only sends through a comm with a kernel

    def __init__(self, log, **kwargs):
        self.log = log
        super().__init__(**kwargs)

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        self.log.append(dict(comm_id=self.comm_id, msg_type=msg_type, data=data or {},
                             buffers=list(buffers or [])))


class CommLog(list):
    """The messages sent by widgets created while the fixture is active."""

    def updates_to(self, widget):
        """The plotly update messages that carry data (`_py2js_update` set, not reset)."""
        return [m for m in self
                if m["comm_id"] == widget.comm.comm_id and m["msg_type"] == "comm_msg"
                and (m["data"].get("state") or {}).get("_py2js_update")]

    def to(self, widget):
        return [m for m in self if m["comm_id"] == widget.comm.comm_id and m["msg_type"] == "comm_msg"]


@pytest.fixture(autouse=True)
def plain_jupyter(monkeypatch):
    """Views see a plain Jupyter front end (plotly), also when the tests run inside VS Code or Colab."""
    import sys

    for name in ("VSCODE_PID", "VSCODE_CWD", "TRAINING_LAB_VIEW"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    return monkeypatch


@pytest.fixture
def comm_log(monkeypatch):
    """Widgets created in the test send into this list (no frontend needed)."""
    log = CommLog()
    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: RecordingComm(log, **k))
    return log


@pytest.fixture(scope="session")
def digits():
    import lab

    (x, y), (x_test, y_test) = lab.datasets.digits()
    # A few hundred samples keep each fit to a fraction of a second.
    return (x[:320], y[:320]), (x_test[:64], y_test[:64])


@pytest.fixture
def make_model():
    def build(metrics=("accuracy",), loss=None, seed=0):
        import keras

        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam",
                      loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=list(metrics))
        return model

    return build


@pytest.fixture
def make_x_only_model():
    """A model trained on inputs alone, as a GAN or an autoencoder is: it logs `recon`, no `loss`."""

    def build(features=6, seed=0):
        import keras
        import tensorflow as tf

        class XOnly(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(features)

            def call(self, x):
                return self.dense(x)

            def train_step(self, data):
                x = data[0] if isinstance(data, tuple) else data
                with tf.GradientTape() as tape:
                    recon = tf.reduce_mean(tf.square(self(x) - x))
                grads = tape.gradient(recon, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                return {"recon": recon}

        keras.utils.set_random_seed(seed)
        model = XOnly()
        model.compile(keras.optimizers.Adam(1e-3))
        model(np.zeros((1, features), np.float32))
        return model

    return build


def synthetic_run(steps, variables=("m/dense/kernel", "m/dense/bias", "m/out/kernel"), seed=0):
    """A lab.Run with `steps` rows of loss, accuracy and gradient norms, built without training."""
    import lab

    rng = np.random.default_rng(seed)
    run = lab.Run(name=f"synthetic-{steps}")
    chunk = 100_000
    for start in range(0, steps, chunk):
        n = min(chunk, steps - start)
        t = np.arange(start, start + n)
        rows = {
            "epoch": t // 1000, "batch": t % 1000, "seconds": np.full(n, 0.001),
            "loss": (2.0 * np.exp(-t / max(steps, 1) * 3) + 0.05 * rng.random(n)).astype(np.float32),
            "accuracy": np.clip(t / max(steps, 1), 0, 1).astype(np.float32),
        }
        for i, name in enumerate(variables):
            rows[f"grad_norm/{name}"] = (10.0 ** (-i) * (1 + rng.random(n))).astype(np.float32)
        run.append_batches(rows)
    return run


@pytest.fixture
def make_run():
    return synthetic_run


class FakeHandle:
    """Stands in for an IPython display handle: keeps every bundle shown through it."""

    def __init__(self, bundle):
        self.shown = [bundle]

    def update(self, bundle, raw=False):
        assert raw
        self.shown.append(bundle)


@pytest.fixture
def fake_handle():
    """A display handle that keeps what is shown through it."""
    return FakeHandle(None)


@pytest.fixture
def displayed(monkeypatch):
    """Records what gets displayed through IPython, by handle (a FakeHandle each)."""
    import IPython.display

    handles = []

    def display(bundle, raw=False, display_id=None):
        assert raw and display_id
        handles.append(FakeHandle(bundle))
        return handles[-1]

    monkeypatch.setattr(IPython.display, "display", display)
    return handles


@pytest.fixture
def notebook(displayed, monkeypatch):
    """Pretends to run in a kernel with a front end; records what gets displayed, by handle."""
    from widgets import dashboard as dashboard_module

    monkeypatch.setattr(dashboard_module, "_frontend_available", lambda: True)
    return displayed

