"""Clicks against a real ipykernel: a frontend's comm messages reach training
that runs on the lab's background thread, and take effect before it ends."""

import os
import queue
import time

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

TIMEOUT = 120
EPOCHS = 10_000  # far more than the test lets run: it must be paused and stopped

SETUP = f"""
import keras, numpy as np
import lab, widgets
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).random((64, 6), dtype=np.float32)
y = (x.sum(axis=1) > 3).astype("int32")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
training = widgets.BackgroundFit(model, x, y, batch_size=8, epochs={EPOCHS})
controls = training.controls()
training.start()
print(controls.pause_button.model_id, controls.continue_button.model_id, controls.stop_button.model_id)
"""


@pytest.fixture(scope="module")
def kernel():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=TIMEOUT)
    try:
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def execute(client, code):
    """Runs code in the kernel; returns what it printed (raises on an error)."""
    msg_id = client.execute(code)
    printed, error = [], None
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no answer from the kernel to {code!r}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            printed.append(content["text"])
        elif kind == "error":
            error = "\n".join(content["traceback"])
        elif kind == "status" and content["execution_state"] == "idle":
            break
    if error:
        raise AssertionError(f"the kernel raised:\n{error}")
    return "".join(printed).strip()


def click(client, model_id):
    """What JupyterLab sends when a Button is clicked."""
    content = {"comm_id": model_id, "data": {"method": "custom", "content": {"event": "click"}}}
    client.shell_channel.send(client.session.msg("comm_msg", content))


def state(client):
    text = execute(client, "print(training.state, training.batches_done)")
    name, done = text.split()
    return name, int(done)


def wait_for(client, wanted):
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        name, done = state(client)
        if name == wanted:
            return done
        time.sleep(0.05)
    raise AssertionError(f"training did not become {wanted!r}; it is {name!r} after {done} batches")


def test_pause_continue_and_stop_clicks_act_while_training_runs(kernel):
    pause, resume, stop = execute(kernel, SETUP).split()[-3:]
    total = EPOCHS * 8
    # The cell came back at once: the kernel is free while the thread trains.
    name, done = state(kernel)
    assert name == "running"
    deadline = time.monotonic() + TIMEOUT
    while done < 5 and time.monotonic() < deadline:  # let it train a little
        time.sleep(0.05)
        name, done = state(kernel)

    click(kernel, pause)
    paused_at = wait_for(kernel, "paused")
    assert 5 <= paused_at < total
    time.sleep(0.5)
    assert state(kernel) == ("paused", paused_at)  # it stays parked

    click(kernel, resume)
    wait_for(kernel, "running")
    deadline = time.monotonic() + TIMEOUT
    while state(kernel)[1] <= paused_at and time.monotonic() < deadline:
        time.sleep(0.05)

    click(kernel, stop)
    stopped_at = wait_for(kernel, "stopped")
    assert paused_at < stopped_at < total
    assert execute(kernel, "print(training.join(10))") == "True"


BREAKPOINT_SETUP = """
recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 5, name="step 5")])
paused_training = widgets.BackgroundFit(model, x, y, batch_size=8, epochs=3, callbacks=[recorder])
paused_controls = paused_training.controls()
paused_training.start()
print(paused_training.wait_for("paused", timeout=60))
"""


def test_a_breakpoint_opens_the_panel_whose_step_and_continue_clicks_act(kernel):
    assert execute(kernel, BREAKPOINT_SETUP) == "True"
    ids = execute(kernel, "panel = paused_controls.panel\n"
                          "print(panel.step_button.model_id, panel.continue_button.model_id)").split()
    step, resume = ids
    click(kernel, step)
    deadline = time.monotonic() + TIMEOUT
    stepped = ""
    while time.monotonic() < deadline:
        stepped = execute(kernel, "print(panel.stepper.next_index, len(panel.stepper.traces))")
        if stepped == "6 1":
            break
        time.sleep(0.05)
    assert stepped == "6 1"  # the panel stepped the batch in flight (step 5)
    click(kernel, resume)
    assert execute(kernel, "print(paused_training.join(60), paused_training.state)") == "True finished"
    sources = execute(kernel, "print(list(recorder.run.batches()['source'].fillna('fit')).count('stepper'))")
    assert sources == "1"
