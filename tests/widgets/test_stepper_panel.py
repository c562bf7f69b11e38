"""StepperPanel driven without a browser: click buttons, read traits and children."""

import struct
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab
import widgets
from widgets.stepper_panel import batch_html, looks_like_images, png_bytes, status_html

(DIGITS_X, DIGITS_Y), _ = lab.datasets.digits()
DIGITS_X, DIGITS_Y = DIGITS_X[:64], DIGITS_Y[:64]
RNG = np.random.default_rng(0)
TABLE_X = RNG.random((40, 6), dtype=np.float32)
TABLE_Y = RNG.integers(0, 3, 40).astype(np.int32)


def make_model(features, classes):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(classes)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


@pytest.fixture
def panel():
    stepper = lab.Stepper(make_model(6, 3), (TABLE_X, TABLE_Y), batch_size=8, history=4)
    return widgets.StepperPanel(stepper)


def test_step_shows_the_step_its_gradients_and_weight_changes(panel):
    assert "not stepped yet" in panel.status.value
    panel.step_button.click()
    assert "step 0" in panel.status.value and "loss" in panel.status.value
    keys = [v.path for v in panel.stepper.model.trainable_variables]
    assert list(panel.gradient_bars.data[0].x) == keys
    assert np.all(np.asarray(panel.gradient_bars.data[0].y) > 0)
    assert len(panel.gradient_histogram.data[0].x) == 6 * 3 + 3  # every gradient value
    assert all(key in panel.weights_view.value for key in keys)
    assert "ŷ" in panel.batch_view.value  # predictions against targets


def test_step_n_rewind_and_the_timeline(panel):
    panel.n_steps.value = 3
    panel.step_n_button.click()
    assert panel.timeline.options == (("0", 0), ("1", 1), ("2", 2))
    assert panel.timeline.value == 2
    panel.rewind_button.click()
    assert [value for _, value in panel.timeline.options] == [0, 1]
    assert "step 1" in panel.status.value
    panel.timeline.value = 0  # clicking back into an earlier step shows it
    assert panel.shown.index == 0 and "step 0" in panel.status.value
    assert panel.stepper.next_index == 2  # looking back does not rewind


def test_rewinding_with_nothing_to_rewind_says_so(panel):
    panel.step_button.click()
    panel.rewind_button.click()
    assert "not stepped yet" in panel.status.value
    panel.rewind_button.click()
    assert "step first" in panel.status.value


def test_continue_is_disabled_without_a_training_to_continue(panel):
    assert panel.continue_button.disabled
    called = []
    panel.set_continue(lambda: called.append(True))
    panel.continue_button.click()
    assert called == [True] and panel.continue_button.disabled and panel.step_button.disabled


def test_run_to_breakpoint_stops_at_the_hit():
    stepper = lab.Stepper(make_model(6, 3), (TABLE_X, TABLE_Y), batch_size=8)
    panel = widgets.StepperPanel(stepper, breakpoints=[lab.Breakpoint(lambda row: row["step"] == 4)])
    panel.run_button.click()
    assert panel.shown.index == 4 and stepper.next_index == 5


def test_an_error_shows_the_message_hint_and_traceback():
    class NoTape(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)  # outside the tape
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                               self.trainable_variables))
            return {"loss": loss}

    model = NoTape()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model(TABLE_X[:1])
    panel = widgets.StepperPanel(lab.Stepper(model, (TABLE_X, TABLE_Y), batch_size=8))
    panel.step_button.click()
    assert "No gradients provided" in panel.status.value
    assert "GradientTape" in panel.status.value and "traceback" in panel.status.value
    assert panel.timeline.options == ()


def test_image_batches_show_as_images_and_tables_as_tables():
    panel = widgets.StepperPanel(lab.Stepper(make_model(64, 10), (DIGITS_X, DIGITS_Y), batch_size=8))
    panel.step_button.click()
    assert panel.batch_view.value.count("<img") == 8
    assert all(f"y={label}" in panel.batch_view.value for label in panel.shown.y)
    assert "ŷ=" in panel.batch_view.value
    table = batch_html(TABLE_X[:4], TABLE_Y[:4], None)
    assert "<table" in table and "x[0]" in table and "<img" not in table
    assert looks_like_images(DIGITS_X.reshape(-1, 8, 8, 1))
    assert not looks_like_images(TABLE_X)


def test_png_bytes_is_a_png_of_the_image():
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    data = png_bytes(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (4, 3)
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    rows = zlib.decompress(data[idat + 4:idat + 4 + length])
    assert rows == b"".join(b"\x00" + image[r].tobytes() for r in range(3))


def test_a_step_that_logs_no_loss_shows_none(make_x_only_model):
    panel = widgets.StepperPanel(lab.Stepper(make_x_only_model(), (TABLE_X,), batch_size=8))
    panel.step_button.click()
    assert "step 0" in panel.status.value and "recon" in panel.status.value
    assert "loss" not in panel.status.value  # "loss nan" would read as divergence
    diverged = lab.StepTrace(index=3, epoch=0, batch=3, row={"loss": float("nan"), "accuracy": 0.5}, seconds=0.01)
    assert "loss <b>nan</b>" in status_html(diverged)  # a loss that is NaN still says so


def test_a_model_with_several_outputs_shows_each_outputs_targets_and_predictions():
    y = {"cls": TABLE_Y[:4], "reg": np.array([[0.5], [1.5], [2.5], [3.5]], np.float32)}
    y_pred = {"cls": np.eye(3, dtype=np.float32)[[2, 1, 0, 0]], "reg": np.full((4, 1), 0.25, np.float32)}
    table = batch_html(TABLE_X[:4], y, y_pred)
    for column in ("y[cls]", "ŷ[cls]", "y[reg]", "ŷ[reg]"):
        assert f"<th>{column}</th>" in table
    assert "<td>3.5</td>" in table and "<td>0.25</td>" in table
    images = batch_html(DIGITS_X[:2], [DIGITS_Y[:2], np.zeros(2)], [np.eye(10)[[4, 7]], np.ones(2)])
    assert "y[0]=" in images and "ŷ[0]=4" in images and "ŷ[0]=7" in images and "ŷ[1]=1" in images
