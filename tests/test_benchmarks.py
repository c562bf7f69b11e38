"""benchmarks/overhead.py: how its figures are held against the targets."""

import importlib.util
import os
import subprocess
import sys
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_benchmark(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def overhead():
    return load_benchmark("overhead")


@pytest.fixture(scope="module")
def watch_overhead():
    return load_benchmark("watch_overhead")


def rounds(ratio, spread, count=7, seed=0):
    """Fit times of `count` rounds around `ratio` seconds, each within +-spread."""
    return list(ratio * (1 + np.random.default_rng(seed).uniform(-spread, spread, count)))


def test_a_target_is_met_missed_or_left_to_noise_by_the_ratio_interval(overhead):
    bare = rounds(1.0, 0.01, seed=1)
    assert overhead.verdict(rounds(1.00, 0.01), bare, 1.05)[0] == "met"
    assert overhead.verdict(rounds(1.20, 0.01), bare, 1.05)[0] == "not met"
    # Rounds that vary by +-20% cannot tell 1.04 from 1.05.
    found, low, high = overhead.verdict(rounds(1.04, 0.2), rounds(1.0, 0.2, seed=1), 1.05)
    assert found == "noise" and low < 1.05 < high


def test_a_load_shared_by_a_round_cancels_out_of_the_interval(overhead):
    # Each round slowed as a whole by up to 40% (another tenant), the watched
    # fit always 10% slower than bare fit in its round: 1.10 misses 1.05.
    load = 1 + np.random.default_rng(2).uniform(0, 0.4, 9)
    bare = load * (1 + np.random.default_rng(3).uniform(-0.01, 0.01, 9))
    watched = 1.10 * load * (1 + np.random.default_rng(4).uniform(-0.01, 0.01, 9))
    found, low, high = overhead.verdict(list(watched), list(bare), 1.05)
    assert found == "not met" and 1.05 < low <= 1.10 <= high < 1.15
    # Rounds of different counts cannot be paired: each is drawn on its own.
    assert overhead.verdict(list(watched), list(bare[:8]), 1.05)[0] == "noise"


def test_every_target_of_the_report_gets_a_row(overhead):
    def result(ratios):
        bare = rounds(1.0, 0.01, seed=1)
        configs = {"bare fit": {"seconds": bare, "median_ratio": 1.0}}
        for name, ratio in ratios.items():
            configs[name] = {"seconds": rounds(ratio, 0.01), "median_ratio": ratio}
        return {"configs": configs}

    names = list(overhead.TARGETS["1"])
    report = {
        "models": {"mlp": {"label": "MLP", "results": {"1": result(dict.fromkeys(names, 1.0)),
                                                        "32": result(dict.fromkeys(names, 1.3))}}},
        "watch": result({"watch()": 1.01}),
    }
    report["watch"]["configs"]["unwatched"] = report["watch"]["configs"].pop("bare fit")
    rows = overhead.target_rows(report)
    assert [(where, name, found) for where, name, _, _, found, _, _ in rows] == (
        [("MLP, spe=1", name, "met") for name in names]
        + [("MLP, spe=32", name, "not met") for name in names]
        + [("hand-written tf.function loop", "`lab.watch()`", "met")])
    assert [limit for _, _, limit, *_ in rows[:3]] == [1.03, 1.05, 1.08]


def test_the_overflow_check_figures_come_for_each_form_and_count():
    step_cost = load_benchmark("step_cost")
    # The benchmark's own counts (6, 18 and 150 tensors) trace for most of a
    # minute; two small ones walk the same code.
    results = step_cost.overflow_check(rounds=2, calls=1, elements=10, counts=(2, 5))
    assert list(results) == [2, 5]
    for row in results.values():
        assert set(row) == {"`norms_of` (one Switch)", "as a `tf.cond`", "no check, us per call"}
        assert all(np.isfinite(v) for v in row.values()) and row["no check, us per call"] > 0


def test_pin_puts_every_thread_of_the_process_on_one_cpu():
    # Threads started before the pin (an import's) are moved too, and later
    # ones (TensorFlow's pools) inherit the mask.
    script = (
        "import os, sys, threading, time\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import overhead\n"
        "stop = threading.Event()\n"
        "early = threading.Thread(target=stop.wait); early.start()\n"
        "overhead.pin(0)\n"
        "late = threading.Thread(target=stop.wait); late.start()\n"
        "masks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}\n"
        "stop.set(); print(len(masks), set(map(tuple, masks.values())))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    count, masks = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 3 and masks == "{(0,)}"


def test_the_hook_share_adds_up_the_time_inside_a_callbacks_hooks_and_keeps_them_working(overhead):
    import time

    import keras

    import lab

    class Slow(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = []

        def on_train_batch_end(self, batch, logs=None):
            self.batches.append(batch)
            time.sleep(0.02)

    slow, recorder = Slow(), lab.Recorder()
    spent = overhead.timed([slow, recorder])
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.zeros((40, 4), np.float32), np.zeros((40, 1), np.float32)
    started = time.perf_counter()
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, callbacks=[slow, recorder])
    seconds = time.perf_counter() - started
    assert slow.batches == [0, 1, 2, 3]  # Keras still calls the wrapped hooks
    assert len(recorder.run) == 4 and recorder.status == "finished"  # and the lab's work as before
    assert 4 * 0.02 <= spent[0] < seconds


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_the_watch_benchmark_takes_turns_in_blocks_and_counts_every_step_and_read(
        watch_overhead, monkeypatch, jit_compile):
    # Configurations take turns every few steps within a round, so a burst
    # of load falls on all of them; each round's time is the sum of a
    # configuration's blocks and its final read of the rows. With
    # --jit-compile every step is compiled by XLA.
    turns, reads, compiled_by = [], [], []
    make_loop = watch_overhead.make_loop

    def counted_loop(model, optimizer, compiled, jit_compile=False):
        loop = make_loop(model, optimizer, compiled, jit_compile)
        compiled_by.append(jit_compile)

        def counted(run, data):
            turns.append((type(run).__name__, len(data)))
            return loop(run, data)

        return counted

    monkeypatch.setattr(watch_overhead, "make_loop", counted_loop)
    from lab.backend.tensorflow.watch import WatchedRun

    flush = WatchedRun.flush
    monkeypatch.setattr(WatchedRun, "flush", lambda run: reads.append((run, len(run._pending))) or flush(run))
    ratios, bare = watch_overhead.measure(True, rounds=2, steps=12, batch_size=8, block=4, jit_compile=jit_compile)
    assert set(ratios) == set(watch_overhead.CONFIGS) and bare > 0
    assert compiled_by == [jit_compile] * 2 * len(watch_overhead.CONFIGS)
    assert ratios["unwatched"]["median_ratio"] == 1.0
    for name, value in ratios.items():
        assert len(value["seconds"]) == 2 and all(s > 0 for s in value["seconds"]), name
    # Each round, on new models: a warm-up of 2 steps per configuration, then
    # the configurations take turns in blocks of 4 steps, 3 blocks each.
    count = len(watch_overhead.CONFIGS)
    for round_turns in (turns[:4 * count], turns[4 * count:]):
        assert [n for _, n in round_turns] == [2] * count + [4] * 3 * count
    # Every step of each watched run is read inside the measurement: 2 of warm-up and 12.
    read = {}
    for run, steps in reads:  # the runs are kept in `reads`: no id is used twice
        read[id(run)] = read.get(id(run), 0) + steps
    watched = [name for name in watch_overhead.CONFIGS if name.startswith("watch")]
    assert len(read) == 2 * len(watched) and set(read.values()) == {2 + 12}, read


def test_the_watch_benchmark_makes_every_model_and_optimizer_before_it_traces_a_step(watch_overhead, monkeypatch):
    # Made and traced one configuration after the other, the last model made
    # ran its steps 7-10% faster, whichever configuration it was; the control
    # (a second unwatched copy) is there to show what is left of such effects.
    made, seen_at_first_step = [], []
    make_mlp, make_loop = watch_overhead.make_mlp, watch_overhead.make_loop

    def counted_mlp():
        made.append(make_mlp())
        return made[-1]

    def checked_loop(model, optimizer, compiled, jit_compile=False):
        loop = make_loop(model, optimizer, compiled, jit_compile)

        def checked(run, data):
            if not seen_at_first_step:
                seen_at_first_step.append((len(made), optimizer.built, len(optimizer.variables)))
            return loop(run, data)

        return checked

    monkeypatch.setattr(watch_overhead, "make_mlp", counted_mlp)
    monkeypatch.setattr(watch_overhead, "make_loop", checked_loop)
    ratios, _ = watch_overhead.measure(True, rounds=1, steps=8, batch_size=8, block=4)
    assert seen_at_first_step[0][:2] == (len(watch_overhead.CONFIGS), True)
    assert seen_at_first_step[0][2] > 2  # Adam's moments, made before the first step
    assert watch_overhead.A_A in ratios
    with watch_overhead.CONFIGS[watch_overhead.A_A](made[0], None, 1.0) as control:
        assert type(control) is watch_overhead.Unwatched


def test_the_fit_benchmark_makes_new_models_each_round_all_before_the_rounds_first_warm_up(
        overhead, monkeypatch, tmp_path):
    import keras

    made, seen = [], []

    class Notes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append([(m.optimizer.built, len(m.optimizer.variables)) for m in made])

    def build():
        made.append(keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)]))
        return made[-1]

    monkeypatch.setattr(overhead, "configs", lambda tmp, every=0.25: {"bare fit": lambda: [Notes()],
                                                                      overhead.A_A: lambda: []})
    result = overhead.measure(build, True, 1, rounds=2, batches=2, epochs=1, tmp=str(tmp_path))
    assert len(made) == 4  # two configurations, two rounds: a new model each
    # bare fit's warm-up and fit in each round: every model made so far is built by then
    assert [len(s) for s in seen] == [2, 2, 4, 4]
    assert all(built and count > 2 for s in seen for built, count in s)
    assert set(result["configs"]) == {"bare fit", overhead.A_A}
    assert len(result["configs"]["bare fit"]["seconds"]) == 2
    assert overhead.A_A in overhead.configs(str(tmp_path))


def test_the_watch_benchmark_reads_each_run_as_often_per_step_as_a_loop_alone(watch_overhead):
    # Taking turns, a run gets one step in every len(CONFIGS): read every
    # 0.25 s of wall time, it would read its rows that many times more often
    # per step than a loop running alone, and count those reads as its cost.
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    make = watch_overhead.CONFIGS["watch()"]
    with make(model, keras.optimizers.SGD(0.1), watch_overhead.FLUSH_EVERY * len(watch_overhead.CONFIGS)) as run:
        assert run.flush_every == 0.25 * len(watch_overhead.CONFIGS)


def _turn_fits(overhead, turns, names, batches, extra=None):
    """name -> a fit of `batches` batches on a model of its own, noting each batch in `seen`."""
    import keras

    seen, inside = [], []

    class Note(keras.callbacks.Callback):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def on_train_batch_begin(self, batch, logs=None):
            inside.append(self.name)
            assert len(inside) == 1, f"{inside} ran at once"

        def on_train_batch_end(self, batch, logs=None):
            inside.remove(self.name)
            seen.append(self.name)

    fits = {}
    for name in names:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        hooks = [Note(name), *(extra or {}).get(name, []), turns.callback(name)]
        x, y = np.zeros((batches * 2, 4), np.float32), np.zeros((batches * 2, 1), np.float32)
        fits[name] = lambda model=model, hooks=hooks, x=x, y=y: model.fit(x, y, batch_size=2, epochs=1,
                                                                          verbose=0, callbacks=hooks)
    return fits, seen


def test_fits_take_turns_one_at_a_time_in_blocks_and_count_their_start_and_end(overhead):
    import itertools
    import random
    import time

    import keras

    class SlowEnd(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            time.sleep(0.2)  # after its last turn passed: the fit's end is its own time too

    names = ["a", "b", "c"]
    turns = overhead.Turns(names, 3, random.Random(0).shuffle)
    fits, seen = _turn_fits(overhead, turns, names, batches=9, extra={"c": [SlowEnd()]})
    turns.run(fits)
    runs = [(name, len(list(group))) for name, group in itertools.groupby(seen)]
    assert sorted(seen) == sorted(names * 9)
    assert all(length == 3 for _, length in runs), runs  # every fit passes the turn every 3 batches
    cycles = [sorted(name for name, _ in runs[i:i + 3]) for i in range(0, len(runs), 3)]
    assert cycles == [names] * 3  # each cycle gives every fit one turn
    assert turns.seconds["c"] >= 0.2 and all(turns.seconds[name] > 0 for name in names)
    assert all(turns.cpu[name] > 0 for name in names)


def test_a_fit_that_raises_while_taking_turns_is_raised_after_the_others_ended(overhead):
    import random

    import keras

    class Fails(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                raise RuntimeError("batch 4 failed")

    turns = overhead.Turns(["a", "b"], 2, random.Random(0).shuffle)
    fits, seen = _turn_fits(overhead, turns, ["a", "b"], batches=8, extra={"a": [Fails()]})
    with pytest.raises(RuntimeError, match="batch 4 failed"):
        turns.run(fits)
    assert seen.count("b") == 8 and seen.count("a") == 5  # b ran to its end, alone after a failed


def test_the_fit_benchmark_feeds_the_fits_without_tf_data_autotuning(overhead):
    batches = overhead.dataset(True, 3)
    assert batches.options().autotune.enabled is False
    assert [tuple(x.shape) for x, _ in batches] == [(overhead.BATCH_SIZE, 64)] * 3


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_the_step_cost_benchmark_times_every_train_function_on_one_model(monkeypatch, jit_compile):
    # The bare function, the control and each probe's function all train the
    # same model, in turns, and each probe's rows keep being written after
    # the probe is taken off the model (its traced function still has them);
    # with --jit-compile, a model compiled by XLA.
    step_cost = load_benchmark("step_cost")
    overhead = load_benchmark("overhead")
    built, probes = [], []
    original_build, original_function = step_cost.build, step_cost.train_function

    def build(*args):
        made = original_build(*args)
        built.append(made[0])
        return made

    def train_function(*args):
        made = original_function(*args)
        probes.append(made[1])
        return made

    monkeypatch.setattr(step_cost, "build", build)
    monkeypatch.setattr(step_cost, "train_function", train_function)
    result = step_cost.measure(overhead, "mlp", 1, blocks=16, jit_compile=jit_compile)
    (model,) = built
    assert model.jit_compile is jit_compile
    functions = 2 + len(step_cost.CONFIGS)
    assert int(model.optimizer.iterations.numpy()) == functions * (3 + 16 * step_cost.BLOCK)
    assert list(result["configs"]) == [step_cost.CONTROL, *step_cost.CONFIGS]
    assert result["configs"][step_cost.CONTROL]["kernels_added"] == 0
    added = [result["configs"][name]["kernels_added"] for name in step_cost.CONFIGS]
    assert 0 < added[0] < added[1] < added[2]
    assert all(np.isfinite(c["median_ratio"]) and c["q1"] <= c["q3"] for c in result["configs"].values())
    for probe in probes[2:]:
        assert probe.buffer.read_count == 3 + 16 * step_cost.BLOCK  # every step's row, read every 16 blocks
        assert not probe.installed


def test_the_step_cost_benchmarks_embedding_trains_by_a_sparse_gradient_that_the_rows_record():
    # `--models embedding`: SGD applies the Embedding's gradient as the
    # sparse slices it is, and the probes' functions record its norm.
    import keras
    import tensorflow as tf

    step_cost = load_benchmark("step_cost")
    overhead = load_benchmark("overhead")
    model, iterator, (x, y) = step_cost.build(overhead, "embedding", 1)
    assert isinstance(model.optimizer, keras.optimizers.SGD) and x.dtype == np.int32
    table = model.trainable_variables[0]
    with tf.GradientTape() as tape:
        loss = model.compute_loss(y=y, y_pred=model(x, training=True))
    assert isinstance(tape.gradient(loss, table), tf.IndexedSlices)
    function, probe, _ = step_cost.train_function(model, iterator, (x, y), 1, {"gradients": True})
    function(iterator)
    rows = probe.read()
    column = rows[f"grad_norm/{table.path}"]
    assert len(column) == 1 and np.isfinite(column).all() and column[0] > 0


def test_the_step_cost_benchmark_can_time_the_nonfinite_gate(monkeypatch):
    # `--nonfinite`: one more train function, traced with the gate of
    # `nonfinite()`, takes its turns with the others and trains (nothing
    # non-finite here: every one of its updates goes in).
    step_cost = load_benchmark("step_cost")
    overhead = load_benchmark("overhead")
    from lab.breakpoints import nonfinite

    probes, original = [], step_cost.train_function

    def train_function(*args):
        made = original(*args)
        probes.append(made[1])
        return made

    monkeypatch.setattr(step_cost, "train_function", train_function)
    result = step_cost.measure(overhead, "mlp", 1, blocks=2,
                               configs={step_cost.NONFINITE: {"breakpoints": [nonfinite()]}})
    assert list(result["configs"]) == [step_cost.CONTROL, step_cost.NONFINITE]
    assert result["configs"][step_cost.NONFINITE]["kernels_added"] > 0
    rows = probes[-1].read()
    assert len(rows["updated"]) == 2 * step_cost.BLOCK
    assert (rows["updated"] == 1).all() and (rows["_hit"] == 0).all() and (rows["_held"] == 0).all()
