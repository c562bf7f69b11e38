"""widgets.Dashboard: records through its Recorder, draws live, fails visibly, renders statically."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab
import widgets


def test_dashboard_is_a_callback_over_a_recorder_and_a_widget():
    dashboard = widgets.Dashboard(breakpoints=[lab.breakpoints.nonfinite()])
    assert isinstance(dashboard, keras.callbacks.Callback)
    assert not isinstance(dashboard, lab.Recorder)  # composition: it holds one
    assert isinstance(dashboard.recorder, lab.Recorder)
    assert dashboard.run is dashboard.recorder.run
    assert dashboard.gradients is True and dashboard.weights is False
    assert dashboard.recorder.gradients is True and len(dashboard.recorder.breakpoints) == 1
    header, controls, figure = dashboard.widget.children
    assert figure is dashboard.chart.figure and controls is dashboard.smoothing_controls
    assert figure.data[0].name == "loss"  # the browser test reads data[0].y


def test_live_fit_draws_loss_metrics_validation_and_gradients(digits, make_model, comm_log, notebook):
    (x, y), validation = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=True, weights=True, refresh_every=0)
    model.fit(x, y, epochs=2, batch_size=32, validation_data=validation, callbacks=[dashboard], verbose=0)

    assert dashboard.status == "finished"
    figure = dashboard.chart.figure
    loss = figure.data[0]
    assert loss.name == "loss" and len(loss.y) == 20
    np.testing.assert_allclose(loss.y, dashboard.run.column("loss"), rtol=1e-6)
    assert len(dashboard.chart.trace("val_loss").x) == 2
    assert len(dashboard.chart.trace("accuracy", "metrics").y) == 20
    layers = [t.name for t in figure.data if t.legend == dashboard.chart.legends["gradients"]]
    assert len(layers) == 2  # two Dense layers, kernel and bias combined
    ratios = [t for t in figure.data if t.legend == dashboard.chart.legends["update_ratios"]]
    assert len(ratios) == 2 and all(np.all(t.y > 0) for t in ratios)
    heat = [t for t in figure.data if t.type == "heatmap"][0]
    assert len(heat.z) == 2 * 20

    header = dashboard.header.value
    assert "finished" in header and "epoch 2/2" in header and "batch 10/10" in header
    assert "steps/s" in header

    # Every refresh was one plotly update, and its arrays went as binary buffers.
    updates = comm_log.updates_to(figure)
    assert 1 <= len(updates) <= dashboard.refreshes
    for message in updates:
        style = message["data"]["state"]["_py2js_update"]["style_data"]
        for values in style.get("y", []):
            assert not isinstance(values, list)  # a JSON list would be slow and 5x larger

    # Shown when training began, updated with the final charts when it ended.
    assert len(notebook) == 1
    first, final = notebook[0].shown[0], notebook[0].shown[-1]
    assert "application/vnd.jupyter.widget-view+json" in final
    assert "running" in first["text/plain"] and "(finished)" in final["text/plain"]
    assert "20 steps, 2 epochs" in final["text/plain"]
    assert final["text/html"].count("<svg") == 5  # loss, metrics, gradient norms, heatmap, update ratios


def test_refreshes_are_rate_limited(digits, make_model):
    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False, refresh_every=60)
    model.fit(x, y, epochs=3, batch_size=8, callbacks=[dashboard], verbose=0)
    assert len(dashboard.run) == 120
    # One at train begin, one at train end; none of the 120 batches forced one.
    assert dashboard.refreshes == 2
    assert len(dashboard.chart.figure.data[0].y) == 120


def test_already_displayed_dashboard_is_not_shown_twice_and_serves_two_fits(digits, make_model, notebook):
    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False)
    dashboard._ipython_display_()
    model.fit(x, y, epochs=1, batch_size=64, callbacks=[dashboard], verbose=0)
    model.fit(x, y, epochs=1, batch_size=64, callbacks=[dashboard], verbose=0)
    assert len(notebook) == 1
    assert len(dashboard.chart.figure.data[0].y) == 10  # steps continue, the chart is one
    assert "10 steps" in notebook[0].shown[-1]["text/plain"]


def test_a_container_showing_the_dashboard_gets_its_final_view(digits, make_model, notebook):
    (x, y), _ = digits
    received = []
    dashboard = widgets.Dashboard(gradients=False).show_inside(received.append)
    make_model().fit(x, y, epochs=1, batch_size=64, callbacks=[dashboard], verbose=0)
    assert notebook == []  # its container shows it: no second output of its own
    assert len(received) == 1
    assert "Dashboard (finished)" in received[0]["text/plain"]
    assert "(finished), 5 steps" in received[0]["text/html"] and "<svg" in received[0]["text/html"]
    with pytest.raises(TypeError, match="callable"):
        widgets.Dashboard().show_inside("panel")


def test_static_bundle_has_charts_and_no_plotly_js(digits, make_model):
    (x, y), validation = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=True)
    model.fit(x, y, epochs=1, batch_size=32, validation_data=validation, callbacks=[dashboard], verbose=0)
    bundle = dashboard._repr_mimebundle_()
    assert bundle["text/plain"].splitlines() == [
        "Dashboard (finished)",
        "10 steps, 1 epochs",
        "series: loss, accuracy, val_accuracy, val_loss",
        "gradient norms: 2 layers",
    ]
    page = bundle["text/html"]
    assert "<svg" in page and "<script" not in page and "plotly" not in page.lower()
    assert len(page) < 100_000


def test_shape_mismatch_shows_failed_with_keras_error(digits, make_model, notebook):
    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard()
    with pytest.raises(ValueError) as raised:
        model.fit(x[:, :10], y, epochs=1, callbacks=[dashboard], verbose=0)
    assert "lab" not in type(raised.value).__module__
    assert dashboard.status == "failed"
    first_line = str(raised.value).strip().splitlines()[0]
    assert first_line[:40] in dashboard.status_detail
    assert "failed" in dashboard.header.value
    final = notebook[0].shown[-1]
    assert "Dashboard (failed: ValueError" in final["text/plain"]
    assert len(dashboard.run.batches()) == 0  # readable, and empty


def test_loss_that_raises_midway_keeps_the_partial_run(digits, make_model, notebook):
    (x, y), _ = digits
    y = y.copy()
    y[100] = 99  # a label the loss refuses, in the 4th batch of 32

    def strict_loss(y_true, y_pred):
        check = tf.debugging.assert_less(tf.reduce_max(y_true), tf.cast(10, y_true.dtype),
                                         message="label out of range")
        # Ordered after the check: otherwise the loss op's own range error may win the race in the graph.
        with tf.control_dependencies([check]):
            return keras.losses.sparse_categorical_crossentropy(tf.identity(y_true), y_pred, from_logits=True)

    model = make_model(loss=strict_loss)
    dashboard = widgets.Dashboard(gradients=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="label out of range"):
        model.fit(x, y, epochs=1, batch_size=32, shuffle=False, callbacks=[dashboard], verbose=0)
    assert dashboard.status == "failed"
    assert "label out of range" in dashboard.status_detail
    assert "label out of range" in dashboard.header.value
    batches = dashboard.run.batches()
    assert batches["step"].tolist() == [0, 1, 2]  # the steps before the failure
    assert dashboard.run.events()["kind"].tolist() == ["error"]
    assert len(dashboard.chart.figure.data[0].y) == 3
    assert "events: error x1" in notebook[0].shown[-1]["text/plain"]


def test_uncompiled_model_raises_keras_error_and_nothing_is_shown(notebook):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    dashboard = widgets.Dashboard()
    with pytest.raises(ValueError, match="compile"):
        model.fit(np.zeros((8, 4)), np.zeros((8, 1)), callbacks=[dashboard], verbose=0)
    assert dashboard.status == "idle" and notebook == []


def test_dashboard_predict_stream_refuses_a_bad_batch_size_when_called(digits, make_model):
    (x, _), _ = digits
    dashboard = widgets.Dashboard()
    with pytest.raises(ValueError, match=r"lab.predict_stream\(batch_size=\.\.\.\) must be"):
        dashboard.predict_stream(make_model(), x, batch_size=0)  # not at the first batch: no next() here
    assert dashboard.prediction_text() == ""


def test_bad_arguments_name_the_fix():
    # Refused at construction, by name; a NaN refresh_every would have stopped every refresh.
    for argument, bad, error in (("refresh_every", -1, ValueError), ("refresh_every", float("nan"), ValueError),
                                 ("refresh_every", "fast", TypeError), ("refresh_budget", 0, ValueError),
                                 ("refresh_budget", 1.5, ValueError), ("refresh_budget", "2%", TypeError),
                                 ("max_points", 1, ValueError), ("max_points", 2000.5, TypeError),
                                 ("max_points", "2000", TypeError)):
        with pytest.raises(error, match=rf"widgets.Dashboard\({argument}=\.\.\.\) must be .*\(e.g. "):
            widgets.Dashboard(**{argument: bad})


def test_a_slow_view_refreshes_less_often_instead_of_slowing_training(digits, make_model, monkeypatch):
    import time

    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False, refresh_every=0, refresh_budget=0.1)
    draw = dashboard.chart.update

    def slow_update(data):
        time.sleep(0.05)  # a refresh costing 50 ms may come at most every 0.5 s
        draw(data)

    monkeypatch.setattr(dashboard.chart, "update", slow_update)
    started = time.monotonic()
    model.fit(x, y, epochs=4, batch_size=8, callbacks=[dashboard], verbose=0)
    seconds = time.monotonic() - started
    assert len(dashboard.run) == 160
    # A tenth of the training time, what its first 3 s allow ahead, and the
    # refresh that overdraws, the one at the start and the one at the end.
    ahead = 0.1 * widgets.dashboard.REFRESH_AHEAD_SECONDS
    assert 2 <= dashboard.refreshes <= (0.1 * seconds + ahead) / 0.05 + 3
    assert len(dashboard.chart.figure.data[0].y) == 160  # the final refresh drew everything


def test_a_slow_first_refresh_does_not_hold_the_chart_back(digits, make_model, monkeypatch):
    # Paced by each refresh alone, the quickstart's first refresh with rows
    # (11 ms, at a 1% budget) held its chart back for 1.1 s of 3 s of training.
    import time

    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False, refresh_every=0.05, refresh_budget=0.1)
    draw = dashboard.chart.update
    drawn = []  # (when a refresh ended, rows it drew)

    def update(data):
        if len(dashboard.run) and not any(rows for _, rows in drawn):
            time.sleep(0.2)  # paced alone, the next refresh would wait 2 s
        draw(data)
        drawn.append((time.monotonic(), len(dashboard.run)))

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.01)

    monkeypatch.setattr(dashboard.chart, "update", update)
    model.fit(x, y, epochs=8, batch_size=16, callbacks=[dashboard, Slow()], verbose=0)
    slow = next(i for i, (_, rows) in enumerate(drawn) if rows)
    later = [(when - drawn[slow][0], rows) for when, rows in drawn[slow + 1:-1]]
    assert later and later[0][0] < 0.5, f"after the slow refresh, the next came at {later}"
    assert later[0][1] > drawn[slow][1]  # with the rows trained since


def test_breakpoint_stops_fit_and_is_marked_on_the_loss_chart(digits, make_model, notebook):
    (x, y), _ = digits
    model = make_model()
    at_step_5 = lab.Breakpoint(lambda row: row["step"] >= 5, name="step 5")
    dashboard = widgets.Dashboard(gradients=False, breakpoints=[at_step_5])
    model.fit(x, y, epochs=2, batch_size=32, callbacks=[dashboard], verbose=0)
    assert dashboard.status == "stopped"
    assert "stopped" in dashboard.header.value and "step 5 at step 5" in dashboard.header.value
    events = dashboard.chart.trace("events")
    assert events.x.tolist() == [5.0]
    assert events.y[0] == pytest.approx(dashboard.run.column("loss")[5])
    assert "breakpoint: step 5 at step 5" in events.hovertext[0]
    assert "events: breakpoint x1" in notebook[0].shown[-1]["text/plain"]


def test_interrupt_inside_a_step_shows_interrupted(digits, make_model):
    (x, y), _ = digits
    calls = []

    def interrupting_loss(y_true, y_pred):
        calls.append(1)
        if len(calls) == 3:  # as if Ctrl-C arrived during the third step
            raise KeyboardInterrupt
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    model = make_model(loss=interrupting_loss)
    model.run_eagerly = True  # the loss runs in Python at every step
    dashboard = widgets.Dashboard(gradients=False)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=1, batch_size=32, callbacks=[dashboard], verbose=0)
    assert dashboard.status == "interrupted"
    assert "interrupted" in dashboard.header.value
    assert len(dashboard.run) == 2


def test_header_shows_progress_rate_and_time_left_while_running(digits, make_model):
    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False, refresh_every=0, refresh_budget=1.0)
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dashboard.header.value)

    model.fit(x, y, epochs=2, batch_size=32, callbacks=[dashboard, Spy()], verbose=0)
    during = seen[14]  # epoch 2, batch 5
    assert "running" in during and "epoch 2/2" in during and "batch 5/10" in during
    assert "steps/s" in during and "left" in during
    assert "left" not in dashboard.header.value  # finished: nothing left to estimate


def test_a_dashboard_follows_a_watched_loop(comm_log, digits):
    import keras
    import tensorflow as tf

    import lab
    import widgets

    (x, y), _ = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dash = widgets.Dashboard(gradients=True)
    with lab.watch(model, optimizer) as run:
        dash.follow(run)
        for i in range(0, 128, 32):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[i : i + 32], model(x[i : i + 32]))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            run.step(loss=loss)
    dash.refresh()
    assert dash.run is run and len(run) == 4
    assert len(dash.chart.figure.data[0].y) == 4
    assert dash.status == run.status == "finished"


def test_a_saved_run_shows_as_a_ghost_behind_the_live_loss(comm_log, digits, make_model, tmp_path):
    import lab
    import widgets

    (x, y), _ = digits
    first = make_model()
    rec = lab.Recorder()
    first.fit(x, y, batch_size=32, callbacks=[rec], verbose=0)
    path = str(tmp_path / "baseline.h5")
    rec.run.name = "baseline"
    rec.run.save(path)
    dash = widgets.Dashboard(gradients=False, ghost=path)
    make_model(seed=1).fit(x, y, batch_size=32, callbacks=[dash], verbose=0)
    ghost = dash.chart.trace("baseline (saved)")
    assert len(ghost.y) == len(rec.run) == 10
    assert dash.chart.figure.data[0].name == "loss" and len(dash.chart.figure.data[0].y) == 10
    np.testing.assert_allclose(ghost.y, rec.run.column("loss"))



def test_the_html_view_draws_the_ghost_once_however_often_it_refreshes(comm_log, digits, make_model, tmp_path):
    # A refresh with nothing new gets the same chart data as the last one:
    # the ghost line is added to a copy, never to that data.
    import lab
    import widgets

    (x, y), _ = digits
    rec = lab.Recorder()
    make_model().fit(x, y, batch_size=32, callbacks=[rec], verbose=0)
    rec.run.name = "baseline"
    dash = widgets.Dashboard(gradients=False, ghost=rec.run, view="html")
    make_model(seed=1).fit(x, y, batch_size=32, callbacks=[dash], verbose=0)
    sent = []
    dash.live_view.send = lambda data, status, final=False: sent.append([s.name for s in data.loss])
    for _ in range(3):
        dash.refresh(final=True)
    assert sent == [["loss", "baseline (saved)", "loss (smoothed)", "events"]] * 3
    assert dash._series.update() is dash._series.update()  # nothing new: nothing recomputed

def test_prediction_progress_shows_in_the_header(comm_log, digits, make_model):
    import widgets

    (x, y), _ = digits
    model = make_model()
    dash = widgets.Dashboard(gradients=False)
    model.fit(x, y, batch_size=32, callbacks=[dash], verbose=0)
    batches = list(dash.predict_stream(model, x, batch_size=64))
    assert len(batches) == 5 and sum(len(b) for b in batches) == len(x)
    assert "predicted 5/5 batches" in dash.header.value
    np.testing.assert_allclose(np.concatenate(batches), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_the_summary_lists_only_series_with_values():
    run = lab.Run("cyclegan")
    run.append_batches({"loss": np.full(3, np.nan, np.float32), "G_loss": np.ones(3, np.float32),
                        "updated/g_opt": np.ones(3, np.float32), "updated/d_opt": np.ones(3, np.float32)})
    summary = widgets.Dashboard(run=run).summary()
    assert "series: G_loss\n" in summary + "\n"  # no all-NaN loss, no update bookkeeping


@pytest.mark.parametrize("steps_per_execution", [4])
def test_the_header_counts_steps_not_executions_at_several_steps_per_execution(digits, steps_per_execution):
    # Keras 3.11+ reports a last, partial execution by its full span: the
    # header read "batch 12/10" and "about -0 s left"; before 3.11 Keras
    # reports one number per execution: the rate and time left were off by
    # the steps per execution.
    (x, y), _ = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    dashboard = widgets.Dashboard(gradients=False, refresh_every=0, refresh_budget=1.0, view="html")
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dashboard.progress_text())

    model.fit(x, y, epochs=2, batch_size=32, callbacks=[dashboard, Spy()], verbose=0)  # 10 batches an epoch
    shown = [text.split(" · ")[1] for text in seen]
    # Keras before 3.11 calls no batch end for the last, partial execution.
    assert shown[:2] == ["batch 4/10", "batch 8/10"] and shown[2] in ("batch 10/10", "batch 4/10")
    assert all(int(text.split()[1].split("/")[0]) <= 10 for text in shown)
    assert "batch 10/10" in dashboard.progress_text()
    assert dashboard._progress["done"] == len(dashboard.run) == 20
    assert not any("-" in text for text in seen)


def test_the_smoothing_control_is_remembered_across_refreshes_and_fits_and_changes_only_the_display(
        digits, make_model, comm_log):
    import pandas as pd

    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False, refresh_every=0)
    on, weight = dashboard.smoothing_controls.children
    assert dashboard.smoothing == 0.6 and on.value and weight.value == 0.6  # TensorBoard's default
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[dashboard], verbose=0)
    raw = dashboard.run.column("loss")
    chart = dashboard.chart
    expected = pd.Series(raw.astype(np.float64)).ewm(alpha=0.4, adjust=True).mean()
    np.testing.assert_allclose(chart.trace("loss (smoothed)").y, expected, rtol=1e-6)
    np.testing.assert_allclose(chart.trace("loss").y, raw, rtol=1e-6)
    assert chart.trace("loss").opacity < 0.5  # the raw line, faint behind

    weight.value = 0.9  # the slider: redrawn at once, from the first step
    expected = pd.Series(raw.astype(np.float64)).ewm(alpha=0.1, adjust=True).mean()
    np.testing.assert_allclose(chart.trace("loss (smoothed)").y, expected, rtol=1e-6)
    on.value = False
    assert dashboard.smoothing == 0 and weight.disabled
    assert len(chart.trace("loss (smoothed)").y) == 0 and chart.trace("loss").opacity == 1
    before = dashboard.run.batches()
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[dashboard], verbose=0)
    assert dashboard.refreshes > 3 and dashboard.smoothing == 0  # every refresh of the second fit kept it off
    assert len(chart.trace("loss (smoothed)").y) == 0 and len(chart.trace("loss").y) == 20
    pd.testing.assert_frame_equal(dashboard.run.batches().iloc[:10], before)  # display-only
    on.value = True
    assert dashboard.smoothing == 0.9 and len(chart.trace("loss (smoothed)").y) == 20  # back with its weight
    dashboard.smoothing = 0.5
    assert (on.value, weight.value, weight.disabled) == (True, 0.5, False)
    with pytest.raises(ValueError, match=r"widgets.Dashboard\(smoothing=...\) must be a weight in \[0, 1\)"):
        widgets.Dashboard(smoothing=1)
    with pytest.raises(TypeError, match="0.6, TensorBoard's default"):
        widgets.Dashboard(smoothing="on")


def test_the_html_view_keeps_the_smoothing_setting_across_its_re_renders(digits, make_model, notebook):
    (x, y), _ = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=False, view="html", refresh_every=0, smoothing=0)
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[dashboard], verbose=0)
    controls, page = notebook
    assert "smoothing: off" in controls.shown[0]["text/plain"]
    assert all("(smoothed)" not in b["text/html"] for b in page.shown)
    on, weight = dashboard.smoothing_controls.children
    on.value = True
    shown = len(page.shown)
    assert 'data-name="loss (smoothed)"' in page.shown[-1]["text/html"]  # redrawn at once
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[dashboard], verbose=0)
    later = [b["text/html"] for b in page.shown[shown:]]
    assert len(later) >= 3 and all('data-name="loss (smoothed)"' in p and 'data-name="accuracy (smoothed)"' in p
                                   for p in later)
