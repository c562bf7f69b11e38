"""widgets.series and widgets.charts: bounded, min/max-preserving series; a figure updated in one message."""

import numpy as np
import pytest

from widgets import charts, downsampling, series


def test_downsample_bounds_100k_steps_and_keeps_extremes():
    rng = np.random.default_rng(1)
    steps = np.arange(100_000)
    loss = rng.random(100_000).astype(np.float32)
    loss[31_337] = 50.0  # a spike a user must not miss
    loss[77_001] = -3.0
    x, y = downsampling.downsample(steps, loss, n_out=2000)
    assert len(x) == len(y) <= 2000
    assert x.dtype == y.dtype == np.float32
    assert y.max() == 50.0 and y.min() == -3.0
    assert 31_337 in x and 77_001 in x
    assert np.all(np.diff(x) > 0)


def test_downsample_keeps_short_series_whole_and_drops_nonfinite():
    x, y = downsampling.downsample(np.arange(5), np.array([1.0, np.nan, 3.0, np.inf, 5.0]))
    assert x.tolist() == [0, 2, 4] and y.tolist() == [1, 3, 5]


def test_downsample_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="n_out must be at least 8"):
        downsampling.downsample(np.arange(10), np.arange(10), n_out=2)
    with pytest.raises(ValueError, match="one length"):
        downsampling.downsample(np.arange(10), np.arange(9))


def test_layer_norm_combines_a_layers_variables_and_keeps_missing_as_nan():
    import lab

    run = lab.Run()
    run.append_batches({"loss": [1.0, 1.0], "grad_norm/m/d/kernel": [3.0, np.nan],
                        "grad_norm/m/d/bias": [4.0, np.nan], "grad_norm/m/o/kernel": [1.0, 2.0]})
    data = series.chart_data(run)
    norms = {s.name: s for s in data.gradients}
    assert norms["m/d"].y.tolist() == [5.0]  # step 1 had no gradient: missing, not zero
    assert norms["m/d"].x.tolist() == [0.0]
    assert norms["m/o"].y.tolist() == [1.0, 2.0]


def test_heatmap_shows_a_vanishing_layer_darker_and_stays_bounded(make_run):
    run = make_run(50_000)
    heat = series.chart_data(run, heatmap_bins=100).heatmap
    assert heat.layers == ("m/dense", "m/out")
    assert len(heat.z) <= 2 * 101
    for column in (heat.x, heat.y, heat.z):
        assert column.ndim == 1 and column.dtype == np.float32
    dense, out = heat.z[heat.y == 0], heat.z[heat.y == 1]
    assert np.all(out < dense - 1.5)  # two decades lower, on a log10 scale
    assert heat.x.min() < 1000 and heat.x.max() > 49_000  # the bins span the run


def test_growing_run_keeps_every_spike_and_stays_bounded(make_run):
    import lab

    rng = np.random.default_rng(3)
    run = lab.Run()
    state = series.ChartState(run, max_points=500)
    spikes = {}
    for chunk in range(40):  # 40 refreshes of 2,500 new rows each: 100,000 steps
        loss = rng.random(2500).astype(np.float32)
        at = int(rng.integers(0, 2500))
        loss[at] = 100.0 + chunk
        spikes[chunk * 2500 + at] = 100.0 + chunk
        run.append_batches({"loss": loss, "grad_norm/m/d/kernel": loss})
        data = state.update()
    loss = data.loss[0]
    assert len(loss.x) <= 500
    assert loss.y.max() == 139.0 and loss.y.min() == pytest.approx(run.column("loss").min())
    # The summary read each row once, yet agrees with summarising the whole run at once.
    whole = series.chart_data(run, max_points=500).loss[0]
    assert abs(len(whole.x) - len(loss.x)) <= 2 and whole.y.max() == loss.y.max()
    assert len(data.heatmap.z) <= series.HEATMAP_BINS + 1


def test_chart_data_is_bounded_whatever_the_run_length(make_run):
    run = make_run(100_000)
    run.append_epoch(0, {"loss": 1.0, "val_loss": 1.2, "val_accuracy": 0.5})
    run.add_event("nonfinite", "loss is nan", step=500)
    data = series.chart_data(run, max_points=1000, heatmap_bins=50)
    lines = data.loss + data.metrics + data.gradients
    assert [s.name for s in data.loss] == ["loss", "val_loss", "events"]
    assert [s.name for s in data.metrics] == ["accuracy", "val_accuracy"]
    assert all(len(s.x) <= 1000 for s in lines)
    assert data.loss[2].x.tolist() == [500.0] and "loss is nan" in data.loss[2].text[0]
    assert 2 * 25 <= len(data.heatmap.z) <= 2 * 51


def test_live_figure_refresh_is_one_update_with_binary_arrays(comm_log, make_run):
    run = make_run(20_000)
    live = charts.LiveFigure(gradients=True, weights=False)
    live.figure.comm  # opened on creation, through the recording comm
    state = series.ChartState(run)
    live.update(state.update())  # adds the traces first seen here
    comm_log.clear()
    run.append_batches({name: np.full(10, 0.5, np.float32) for name in run.columns
                        if name not in ("step", "epoch", "batch")})
    live.update(state.update())
    updates = comm_log.updates_to(live.figure)
    assert len(updates) == 1
    other = [m for m in comm_log.to(live.figure) if "_py2js_update" not in m["data"]["state"]
             and not set(m["data"]["state"]) <= {"_last_trace_edit_id", "_last_layout_edit_id"}]
    assert other == []  # no separate restyle or relayout messages
    message = updates[0]
    assert len(message["buffers"]) >= 2 * 4  # x and y of loss, accuracy, two layers, heatmap
    assert sum(len(memoryview(b).cast("B")) for b in message["buffers"]) <= 4 * 2000 * 2 * 6 + 4 * 3 * 400
    style = message["data"]["state"]["_py2js_update"]["style_data"]
    assert all(not isinstance(v, list) or not v or not isinstance(v[0], list) for v in style.get("z", []))
    assert live.figure.data[0].name == "loss"
    assert live.figure.layout.yaxis3.type == "log"


def _received(message):
    """The arrays and values of a plotly update message as the frontend decodes them."""
    from ipywidgets.widgets.widget import _put_buffers

    state = message["data"]["state"]
    _put_buffers(state, message["data"]["buffer_paths"], message["buffers"])
    update = state["_py2js_update"]

    def decoded(value):
        if isinstance(value, dict) and "buffer" in value:
            return np.frombuffer(value["buffer"], value["dtype"])
        return value

    traces = {name: dict(zip(update["style_traces"], map(decoded, values)))
              for name, values in update["style_data"].items()}
    return traces, update["layout_data"]


def test_a_refresh_sends_exactly_the_series_drawn_and_validates_no_array(comm_log, make_run, monkeypatch):
    import _plotly_utils.basevalidators as validators

    run = make_run(5_000)
    live = charts.LiveFigure(gradients=True, weights=False)
    state = series.ChartState(run)
    first = state.update()
    comm_log.clear()
    live.update(first)  # adds the traces first seen here, and names the heatmap's layers
    axis = charts._axis_name(live.figure, live.figure.data[live._traces[("heatmap", "heatmap")]])
    assert list(live.figure.layout[axis].ticktext) == list(first.heatmap.layers) == ["m/dense", "m/out"]
    _, layout = _received(comm_log.updates_to(live.figure)[-1])
    assert layout[f"{axis}.ticktext"] == ["m/dense", "m/out"]  # in the same message as the data
    run.add_event("nonfinite", "loss is nan", step=5_020)
    validated = []
    copy = validators.copy_to_readonly_numpy_array
    monkeypatch.setattr(validators, "copy_to_readonly_numpy_array", lambda *a, **k: validated.append(1) or copy(*a, **k))
    comm_log.clear()
    run.append_batches({name: np.full(50, 0.5, np.float32) for name in run.columns
                        if name not in ("step", "epoch", "batch")})
    data = state.update()
    live.update(data)
    assert validated == []  # plotly's per-array validation is what made refreshes slow
    [message] = comm_log.updates_to(live.figure)
    traces, layout = _received(message)
    drawn = [("loss", s) for s in data.loss] + [("metrics", s) for s in data.metrics] + \
        [("gradients", s) for s in data.gradients]
    for panel, line in drawn:
        index = live._traces[(panel, line.name)]
        np.testing.assert_array_equal(traces["x"][index], line.x)
        np.testing.assert_array_equal(traces["y"][index], line.y)
        assert traces["x"][index].dtype == np.float32  # a binary buffer, not JSON
        np.testing.assert_array_equal(live.figure.data[index].y, line.y)  # the Python side agrees
    events = live._traces[("loss", "events")]
    assert traces["hovertext"][events] == ["nonfinite: loss is nan"]
    heat = live._traces[("heatmap", "heatmap")]
    np.testing.assert_array_equal(traces["z"][heat], data.heatmap.z)
    assert traces["z"][events] == "_undefined_"  # a trace that does not take a property keeps its own
    assert layout == {}  # the layers did not change: no new ticks
    comm_log.clear()
    live.update(data)
    assert comm_log.updates_to(live.figure) == []  # nothing changed, nothing sent


def test_event_markers_and_validation_points_follow_new_events_epochs_and_rows(make_run):
    run = make_run(100)
    state = series.ChartState(run)
    assert state.update().loss[-1].x.tolist() == []
    run.add_event("nonfinite", "loss is nan", step=120)  # its row has not arrived yet
    marked = state.update().loss[-1]
    assert marked.x.tolist() == [120.0] and marked.y[0] == run.column("loss")[99]
    run.append_batches({name: np.full(30, 0.25, np.float32) for name in run.columns
                        if name not in ("step", "epoch", "batch")})
    assert state.update().loss[-1].y[0] == 0.25  # marked at its own step's loss once it is there
    run.add_event("breakpoint", "step 50", step=50)
    run.add_event("mode", "graph -> xla", step=60)  # not an event the chart marks
    assert state.update().loss[-1].x.tolist() == [120.0, 50.0]
    assert [s.name for s in state.update().loss] == ["loss", "events"]
    run.append_epoch(0, {"loss": 0.5, "val_loss": 0.75, "val_accuracy": 0.5})
    data = state.update()
    assert [s.name for s in data.loss] == ["loss", "val_loss", "events"]
    assert data.loss[1].y.tolist() == [0.75] and [s.name for s in data.metrics] == ["accuracy", "val_accuracy"]


def test_a_first_refresh_adds_its_new_traces_in_one_message_and_draws_them_in_the_update(
        comm_log, make_run, monkeypatch):
    # One add_trace per new series, each with empty arrays, took 52 of the 63 ms
    # of a 25-layer model's first refresh (a message per trace, every array
    # validated twice); that refresh set the pace of the next ones.
    import _plotly_utils.basevalidators as validators

    run = make_run(5_000)
    live = charts.LiveFigure(gradients=True, weights=False)
    state = series.ChartState(run)
    data = state.update()
    validated = []
    copy = validators.copy_to_readonly_numpy_array
    monkeypatch.setattr(validators, "copy_to_readonly_numpy_array", lambda *a, **k: validated.append(1) or copy(*a, **k))
    comm_log.clear()
    live.update(data)
    adds = [m["data"]["state"]["_py2js_addTraces"] for m in comm_log.to(live.figure)
            if m["data"]["state"].get("_py2js_addTraces")]
    drawn = [("loss", s) for s in data.loss] + [("metrics", s) for s in data.metrics] + \
        [("gradients", s) for s in data.gradients]
    assert len(adds) == 1 and len(adds[0]["trace_data"]) == len(drawn) - 1  # all but the loss, there from the start
    assert validated == []
    [update] = comm_log.updates_to(live.figure)
    traces, _ = _received(update)
    for panel, line in drawn:
        index = live._traces[(panel, line.name)]
        np.testing.assert_array_equal(traces["y"][index], line.y)
        np.testing.assert_array_equal(live.figure.data[index].y, line.y)  # the Python side agrees
    names = [t.name for t in live.figure.data]
    assert names[0] == "loss" and len(set(names)) == len(names)


def test_a_long_runs_line_starts_and_ends_at_its_first_and_last_recorded_values():
    import re

    import lab
    from widgets import static

    rng = np.random.default_rng(1)
    steps = 20_000
    loss = (1 + rng.random(steps)).astype(np.float32)
    loss[0] = loss[-1] = 1.5  # inside their buckets' ranges: neither a bucket's min nor its max
    run = lab.Run()
    state = series.ChartState(run, max_points=2000)
    for start in range(0, steps, 320):  # appended in blocks, as the recorder does
        run.append_batches({"loss": loss[start:start + 320]})
        data = state.update()
    line = data.loss[0]
    assert (line.x[0], line.y[0]) == (0, 1.5)
    assert (line.x[-1], line.y[-1]) == (steps - 1, 1.5)
    assert line.y.min() == loss.min() and line.y.max() == loss.max()  # the envelope is kept
    whole = series.chart_data(run).loss[0]
    assert (whole.x[-1], whole.y[-1]) == (steps - 1, 1.5)
    svg = static.line_chart(data.loss, "loss")  # the static view redraws it with fewer points
    assert re.search(r'data-name="loss" data-last="([^"]+)"', svg).group(1) == "1.5"


def gan_run(steps=4, loss=None):
    """A run as a GAN records it: d_loss and g_loss, no loss; the updated/learning-rate bookkeeping."""
    import lab

    run = lab.Run("gan")
    columns = {"d_loss": np.linspace(0.6, 0.7, steps, dtype=np.float32),
               "g_loss": np.linspace(0.5, 0.6, steps, dtype=np.float32),
               "updated": np.ones(steps, np.float32),
               "updated/d_optimizer": np.ones(steps, np.float32),
               "updated/g_optimizer": np.ones(steps, np.float32),
               "applies/d_optimizer": np.full(steps, 2.0, np.float32),
               "learning_rate/d_optimizer": np.full(steps, 1e-3, np.float32)}
    if loss is not None:
        columns = {"loss": np.full(steps, loss, np.float32), **columns}
    run.append_batches(columns)
    return run


@pytest.mark.parametrize("loss", [None, np.nan], ids=["no loss column", "loss all NaN"])
def test_events_of_a_run_without_a_finite_loss_are_marked_on_its_first_metric(comm_log, loss):
    from widgets import static

    run = gan_run(loss=loss)
    run.add_event("nonfinite", "d_loss is nan", step=2)
    data = series.chart_data(run)
    [events] = [s for s in data.metrics if s.name == "events"]
    assert events.x.tolist() == [2.0] and events.y.tolist() == [run.column("d_loss")[2]]
    assert "stroke=\"crimson\"" in static.charts_html(data)  # the static view draws the marker
    live = charts.LiveFigure(gradients=False)
    live.update(data)
    trace = live.trace("events")
    assert trace.y.tolist() == events.y.tolist()
    # On the metrics' axis, where d_loss is drawn, not alone on the empty loss axis.
    assert trace.yaxis == live.trace("d_loss", panel="metrics").yaxis != live.trace("loss").yaxis


def test_event_markers_move_to_the_loss_axis_once_the_loss_has_values(comm_log):
    run = gan_run()
    run.add_event("breakpoint", "step 1", step=1)
    live = charts.LiveFigure(gradients=False)
    state = series.ChartState(run)
    live.update(state.update())
    assert live.trace("events").yaxis == "y2"
    run.append_batches({"loss": np.full(3, 0.25, np.float32), "d_loss": np.full(3, 0.5, np.float32)})
    live.update(state.update())
    # The one events trace moved: no second, stale "events" entry stays behind.
    assert [t.name for t in live.figure.data].count("events") == 1
    assert live.trace("events").yaxis == live.trace("loss").yaxis == "y"


def test_bookkeeping_columns_are_not_charted_as_metrics():
    data = series.chart_data(gan_run())
    assert [s.name for s in data.metrics] == ["d_loss", "g_loss", "events"]
    assert [s.name for s in data.loss] == []


# ---- smoothing, legends and colours ------------------------------------------------


def tensorboard_ema(values, weight):
    """TensorBoard's smoothing, written out as its scalar dashboard does it: a
    debiased exponential moving average that skips non-finite values."""
    last, count, smoothed = 0.0, 0, []
    for value in values:
        if not np.isfinite(value):
            smoothed.append(np.nan)
            continue
        last = last * weight + (1 - weight) * float(value)
        count += 1
        smoothed.append(last / (1 - weight ** count))
    return np.array(smoothed)


def noisy_run(steps, seed=0):
    import lab

    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    loss = (2 * np.exp(-t / 300) + 0.3 * rng.random(steps)).astype(np.float32)
    loss[[7, 8, 150]] = [np.nan, np.inf, np.nan]  # a nonfinite step or three
    run = lab.Run()
    run.append_batches({"loss": loss, "accuracy": (1 - np.exp(-t / 300) + 0.1 * rng.random(steps)).astype(np.float32)})
    return run


def test_smoothing_is_tensorboards_debiased_ema_drawn_over_a_faint_raw_line_and_leaves_the_run_alone():
    import pandas as pd

    import lab

    source = noisy_run(1_000)
    before = source.batches()
    run = lab.Run()
    state = series.ChartState(run, smoothing=0.6)
    for start in range(0, 1_000, 37):  # refreshes between blocks of rows, as while training
        run.append_batches({c: source.column(c)[start:start + 37] for c in ("loss", "accuracy")})
        data = state.update()
    pd.testing.assert_frame_equal(source.batches(), before)  # display-only
    for panel, name in (("loss", "loss"), ("metrics", "accuracy")):
        lines = {s.name: s for s in getattr(data, panel)}
        raw, smoothed = lines[name], lines[f"{name} (smoothed)"]
        values = run.column(name)
        reference = tensorboard_ema(values, 0.6)
        # The same numbers as pandas' adjusted ewm over the finite values: the
        # debiasing makes the line start at the first value, not at 0.
        finite = np.isfinite(values)
        ewm = pd.Series(values[finite].astype(np.float64)).ewm(alpha=0.4, adjust=True).mean()
        np.testing.assert_allclose(reference[finite], ewm, rtol=1e-12)
        assert smoothed.x.tolist() == np.flatnonzero(finite).tolist()  # 997 points: nothing downsampled
        np.testing.assert_allclose(smoothed.y, reference[finite], rtol=1e-6)
        assert smoothed.y[0] == values[0]
        np.testing.assert_array_equal(raw.y, values[finite])  # the raw line is the run's own values
        assert raw.faint and not smoothed.faint and raw.color == smoothed.color
        assert np.std(np.diff(smoothed.y)) < 0.5 * np.std(np.diff(raw.y))  # it is smoother

    state.smoothing = 0.9  # a new weight: redrawn from the first row
    data = state.update()
    np.testing.assert_allclose(data.loss[1].y, tensorboard_ema(run.column("loss"), 0.9)[np.isfinite(run.column("loss"))],
                               rtol=1e-6)
    state.smoothing = 0
    data = state.update()
    assert [s.name for s in data.loss] == ["loss", "events"] and not data.loss[0].faint
    with pytest.raises(ValueError, match=r"smoothing=...\) must be a weight in \[0, 1\)"):
        state.smoothing = 1.0


def test_a_long_runs_smoothed_line_is_bounded_and_each_point_is_the_ema_at_its_step():
    run = noisy_run(60_000, seed=2)
    state = series.ChartState(run, max_points=1000, smoothing=0.99)
    state.update()
    run.append_batches({"loss": np.full(500, 0.1, np.float32), "accuracy": np.full(500, 0.9, np.float32)})
    smoothed = state.update().loss[1]
    assert smoothed.name == "loss (smoothed)" and len(smoothed.x) <= 1000
    reference = tensorboard_ema(run.column("loss"), 0.99)
    np.testing.assert_allclose(smoothed.y, reference[smoothed.x.astype(np.int64)], rtol=1e-5)
    assert smoothed.x[-1] == len(run) - 1


def test_each_plotly_row_has_its_own_legend_and_loss_and_metrics_differ_in_colour(comm_log):
    run = noisy_run(300)
    run.append_epoch(0, {"loss": 1.0, "val_loss": 1.1, "val_accuracy": 0.5})
    run.append_batches({"grad_norm/m/d/kernel": np.ones(3, np.float32), "loss": np.ones(3, np.float32)})
    live = charts.LiveFigure(gradients=True)
    state = series.ChartState(run, smoothing=0.6)
    live.update(state.update())
    layout = live.figure.layout
    rows = {"loss": "y", "metrics": "y2", "gradients": "y3"}
    assert set(live.legends) == set(rows)  # none for the heatmap, which has its colour bar
    for panel, axis in rows.items():
        legend = live.legends[panel]
        top = layout[f"yaxis{axis[1:]}"].domain[1]
        # Beside its own row: right of the plot, level with the row's top.
        assert layout[legend].x > 1 and layout[legend].y == top and layout[legend].yanchor == "top"
        for trace in live.figure.data:
            if trace.type == "scatter" and trace.yaxis == axis:
                assert trace.legend == legend, (trace.name, panel)
    loss, accuracy = live.trace("loss (smoothed)"), live.trace("accuracy (smoothed)", "metrics")
    assert loss.line.color != accuracy.line.color
    assert live.trace("val_loss").marker.color == loss.line.color
    assert live.trace("val_accuracy", "metrics").marker.color == accuracy.line.color
    assert live.trace("m/d", "gradients").line.color not in (loss.line.color, accuracy.line.color)
    raw = live.trace("loss")
    assert raw.opacity < 0.5 and raw.showlegend is False and raw.line.color == loss.line.color
    assert loss.showlegend is not False and loss.opacity == 1

    state.smoothing = 0  # off: the smoothed lines go, the raw ones come back in full
    comm_log.clear()
    live.update(state.update())
    [message] = comm_log.updates_to(live.figure)
    assert len(live.trace("loss (smoothed)").y) == 0 and len(live.trace("accuracy (smoothed)", "metrics").y) == 0
    assert live.trace("loss").opacity == 1 and live.trace("loss").showlegend is True
    # What the front end gets: plotly's front end resets a property sent as
    # undefined to its default, so every line in the message carries its own.
    traces, _ = _received(message)
    lines = [i for i, t in enumerate(live.figure.data) if t.type == "scatter" and i in traces["opacity"]]
    assert len(lines) >= 4 and all(traces["opacity"][i] == live.figure.data[i].opacity for i in lines)
    assert traces["showlegend"][live._traces[("loss", "loss")]] is True
    assert len(traces["y"][live._traces[("loss", "loss (smoothed)")]]) == 0


def test_the_svg_charts_give_loss_and_metrics_a_chart_and_a_legend_each():
    import re

    from widgets import static

    run = noisy_run(200)
    run.append_epoch(0, {"loss": 1.0, "val_loss": 1.1, "val_accuracy": 0.5})
    page = static.charts_html(series.chart_data(run, smoothing=0.6))
    loss_chart, metrics_chart = re.findall(r"<svg[\s\S]*?</svg>", page)
    assert "loss per batch" in loss_chart and "metrics per batch" in metrics_chart

    def legend(svg):
        return re.findall(r'<text x="[^"]+" y="[^"]+" font-size="10">([^<]+)</text>', svg)

    def stroke(svg, name):
        return re.search(rf'data-name="{re.escape(name)}"[^>]* stroke="([^"]+)"', svg).group(1)

    assert legend(loss_chart) == ["loss (smoothed)", "val_loss"]  # the faint raw line has no entry
    assert legend(metrics_chart) == ["accuracy (smoothed)", "val_accuracy"]
    assert stroke(loss_chart, "loss") == stroke(loss_chart, "loss (smoothed)") != stroke(metrics_chart, "accuracy")
    assert 'data-name="loss" data-last' in loss_chart and 'stroke-opacity="0.3"' in loss_chart
    # A run without metrics draws the loss chart alone; one without a loss (a GAN's d_loss, g_loss), the metrics.
    assert static.charts_html(series.chart_data(gan_run())).count("<svg") == 1
