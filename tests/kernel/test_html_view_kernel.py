"""The HTML view against a real ipykernel started as VS Code starts one (`VSCODE_PID` set):
`Dashboard()` picks the HTML view by itself, displays its page as one output and updates it in
place (its smoothing control, core ipywidgets, is an output of its own above it)."""

import os
import queue
import re
import time

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

TIMEOUT = 180

CELL = """
import keras, numpy as np
import widgets
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).random((160, 6), dtype=np.float32)
y = (x.sum(axis=1) > 3).astype("int32")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
dash = widgets.Dashboard(gradients=True, refresh_every=0)
model.fit(x, y, batch_size=8, epochs=2, callbacks=[dash], verbose=0)
print(dash.live_view.kind, len(dash.run), float(dash.run.batches()["loss"].iloc[-1]))
"""


def test_a_vscode_kernel_draws_the_dashboard_as_one_html_output_updated_in_place():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", VSCODE_PID="4242")
    env.pop("TRAINING_LAB_VIEW", None)
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=TIMEOUT)
        messages = run_cell(client, CELL)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)

    kinds = [m["msg_type"] for m in messages]
    assert "error" not in kinds, [m["content"] for m in messages if m["msg_type"] == "error"]
    assert "clear_output" not in kinds
    printed = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream"
                      and m["content"]["name"] == "stdout").split()
    assert printed[:2] == ["html", "40"]
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    updates = [m for m in messages if m["msg_type"] == "update_display_data"]
    widget_view = "application/vnd.jupyter.widget-view+json"
    # The smoothing control (core ipywidgets, which VS Code and Colab draw) is
    # its own output above the page; the page is no widget.
    controls = [m for m in shown if widget_view in m["content"]["data"]]
    pages = [m for m in shown if widget_view not in m["content"]["data"]]
    assert len(controls) == 1 and shown.index(controls[0]) < shown.index(pages[0])
    assert len(pages) == 1  # the page displayed once, with a display id ...
    display_id = pages[0]["content"]["transient"]["display_id"]
    assert len(updates) >= 2  # ... and updated in place while fit() ran
    assert all(u["content"]["transient"]["display_id"] == display_id for u in updates)
    for message in pages + updates:
        assert widget_view not in message["content"]["data"]
    final = updates[-1]["content"]["data"]["text/html"]
    line = re.search(r'<polyline data-name="loss" data-last="([^"]+)"[^>]* points="([^"]*)"', final)
    assert len(line.group(2).split()) == 40
    assert float(line.group(1)) == pytest.approx(float(printed[2]), rel=1e-6)
    assert "(finished), 40 steps" in final


def run_cell(client, code):
    """Every iopub message the cell caused, until the kernel is idle again."""
    msg_id = client.execute(code)
    messages = []
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("no answer from the kernel") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        messages.append(msg)
