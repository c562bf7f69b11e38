"""What one Dashboard refresh costs as a run grows: 1e3 to 1e6 recorded steps.

Builds `lab.Run`s of synthetic rows (loss, accuracy, learning rate and the
gradient norms of a 20-variable model, as `lab.Recorder(gradients=True)`
records them), then times refreshes of the Dashboard's figure against a
recording comm (no browser), as the Dashboard makes them: `ChartState.update`
(read the new rows, fold them into the bounded summaries, smooth the loss
and metric lines at the Dashboard's default weight, downsample) and the
plotly update it sends. Payload is what goes over the
wire: binary buffers plus the JSON of the message. Beside it, the HTML view
(`widgets.html_view.HtmlView`, for Colab and VS Code): the bytes of the one
display update a refresh sends (the page of SVG charts) and the time to
draw it. Last, what moving the smoothing slider costs once: the update
that redraws the smoothed lines from the first row (the one step whose cost
grows with the run).

Run: `python benchmarks/refresh.py` (about half a minute; `--quick` stops at 1e5).
"""

import argparse
import json
import statistics
import time

import types

import comm
import numpy as np
from comm.base_comm import BaseComm

import lab
from widgets.charts import LiveFigure
from widgets.html_view import HtmlView
from widgets.series import ChartState
from widgets.smoothing import DEFAULT_WEIGHT

VARIABLES = [f"mlp/dense_{i}/{part}" for i in range(10) for part in ("kernel", "bias")]


class _CountingComm(BaseComm):
    kernel = "recording"
    messages = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        size = sum(memoryview(b).nbytes for b in buffers or [])
        size += len(json.dumps(data, default=lambda o: None))
        _CountingComm.messages.append((msg_type, size))


def synthetic_run(steps, seed=0):
    """A run with `steps` rows shaped like a 20-variable model recorded with gradients."""
    rng = np.random.default_rng(seed)
    run = lab.Run(name=f"synthetic-{steps}")
    chunk = 250_000
    for start in range(0, steps, chunk):
        n = min(chunk, steps - start)
        t = np.arange(start, start + n)
        rows = {"epoch": t // 1000, "batch": t % 1000, "seconds": np.full(n, 1e-3),
                "loss": (np.exp(-3 * t / steps) + 0.05 * rng.random(n)).astype(np.float32),
                "accuracy": (t / steps).astype(np.float32),
                "learning_rate": np.full(n, 1e-3, np.float32),
                "grad_norm": rng.random(n).astype(np.float32)}
        for i, name in enumerate(VARIABLES):
            rows[f"grad_norm/{name}"] = (10.0 ** (-i / 4) * (1 + rng.random(n))).astype(np.float32)
        run.append_batches(rows)
    return run


def measure(steps, repeats=5):
    run = synthetic_run(steps)
    for e in range(3):
        run.append_epoch(e, {"loss": 1.0, "val_loss": 1.1, "val_accuracy": 0.5})
    live = LiveFigure(gradients=True)
    state = ChartState(run, smoothing=DEFAULT_WEIGHT)
    live.update(state.update())  # the first draw reads every row and adds the traces
    page = HtmlView(widget=types.SimpleNamespace(value=""), update_every=0)
    compute, send, sizes, counts, html_ms, html_bytes = [], [], [], [], [], []
    for _ in range(repeats):
        # New rows between refreshes, as during training, so every trace changes.
        run.append_batches({c: np.full(8, 0.5, np.float32) for c in run.columns
                            if c not in ("step", "epoch", "batch")})
        _CountingComm.messages.clear()
        t0 = time.perf_counter()
        data = state.update()
        t1 = time.perf_counter()
        live.update(data)
        t2 = time.perf_counter()
        compute.append(t1 - t0)
        send.append(t2 - t1)
        sizes.append(sum(size for _, size in _CountingComm.messages))
        counts.append(len(_CountingComm.messages))
        t3 = time.perf_counter()
        page.send(data, "<b>running</b>")
        html_ms.append(time.perf_counter() - t3)
        html_bytes.append(len(page.widget.value.encode()))
    state.smoothing = 0.9
    t4 = time.perf_counter()
    state.update()
    reweight = time.perf_counter() - t4
    points = max(len(s.x) for s in data.loss + data.metrics + data.gradients)
    memory = sum(run.column(c).nbytes for c in run.columns
                 if c not in ("step", "epoch", "batch", "seconds", "mode"))
    return dict(steps=steps, traces=len(live.figure.data), points=points,
                messages=statistics.median(counts), payload_kb=statistics.median(sizes) / 1e3,
                compute_ms=statistics.median(compute) * 1e3, send_ms=statistics.median(send) * 1e3,
                html_kb=statistics.median(html_bytes) / 1e3, html_ms=statistics.median(html_ms) * 1e3,
                reweight_ms=reweight * 1e3,
                value_bytes_per_step=memory / len(run))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stop at 1e5 steps")
    args = parser.parse_args(argv)
    comm.create_comm = lambda *a, **k: _CountingComm(**k)
    sizes = [1_000, 10_000, 100_000] + ([] if args.quick else [1_000_000])
    print(f"{'steps':>9} {'traces':>6} {'max pts':>7} {'comm msgs':>9} {'payload kB':>10} "
          f"{'compute ms':>10} {'send ms':>8} {'html kB':>8} {'html ms':>8} {'value B/step':>12} {'reweight ms':>11}")
    for steps in sizes:
        r = measure(steps)
        print(f"{r['steps']:>9,} {r['traces']:>6} {r['points']:>7} {r['messages']:>9.0f} "
              f"{r['payload_kb']:>10.1f} {r['compute_ms']:>10.1f} {r['send_ms']:>8.1f} "
              f"{r['html_kb']:>8.1f} {r['html_ms']:>8.1f} {r['value_bytes_per_step']:>12.0f} {r['reweight_ms']:>11.1f}")
    print("comm msgs: plotly's update protocol, per refresh: two edit counters, the one "
          "update carrying every array, and its reset. html kB / ms: the HTML view's one display "
          "update per refresh (SVG page) and the time to draw it. reweight ms: the one update after "
          "the smoothing weight changed (smoothed lines redrawn from the first row).")


if __name__ == "__main__":
    main()
