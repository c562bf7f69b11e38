"""compare_modes: the same training steps timed in each execution mode.

Each (mode, steps_per_execution) run trains the same cached batches from the
same copy of the model's state, so the runs differ only in how the step runs.
The input pipeline is timed alone as well, to say whether the input or the
model bounds training. Comparing does not change what training does next:
the model's state and every random stream a step draws from are as they
were.
"""

import collections.abc
import math
import numbers
import random
import statistics
import time
import warnings

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from lab.backend.tensorflow.modes import (
    END_OF_DATA,
    XLA_COMPILE_HINT,
    MODES,
    ModeError,
    check_compiled,
    check_mode,
    check_steps_per_execution,
    check_xla,
    set_attributes,
    Settings,
    is_training,
)
from lab.backend.tensorflow.compat import (
    array_batches,
    eager_op_seeds,
    fit_builds_first,
    keras_global_seed_generator,
    set_eager_op_seeds,
    set_keras_global_seed_generator,
    symbolic_build,
    tf_global_generator,
)
from lab.arguments import check_number
from lab.backend.tensorflow.data_check import INSPECT_POINTER, check_arrays_for, problem_with_batch
from lab.step_logs import add_note
from lab.mode_report import bottleneck
from lab.backend.tensorflow.feed import read_through, reading_copy
from lab.hooks import hooks_for
from lab.backend.tensorflow.state import held_variables, raw_variable, replica_copies
from lab.variables import find_optimizers


def compare_modes(model, data, steps=32, batch_size=None, modes=MODES, steps_per_execution=None):
    """Times the same training steps in each mode, each from the same starting state.

    Every (mode, steps_per_execution) pair trains `steps` batches, the same
    batches, starting from a copy of the model's weights, optimizer and metric
    state. The first call of the train function (tracing, XLA compiling) is
    timed apart from the steps after it. The input is timed alone too: the
    batches per second `data` yields without training (the median of
    several timings long enough for the clock), so the result says whether
    the input or the model bounds the run. Afterwards the model is as it
    was: weights, optimizer and metric state, mode, `steps_per_execution` and
    compiled functions (an unbuilt model or optimizer is left built), and so
    are the random streams a step draws from (Python's and NumPy's global
    ones, Keras' for unseeded `keras.random` draws, TensorFlow's global
    generator and its op seeds for eager random ops): the next `fit()`
    trains exactly as it would have. A Dataset is read through a copy of
    its pipeline with shuffle seeds and caches of its own
    (`lab.backend.tensorflow.feed.reading_copy`), so the `fit()` after reads the batches, and
    the order, it would have; where no copy is made (arrays over
    `lab.backend.tensorflow.feed.COPY_LIMIT`, a pipeline TensorFlow cannot serialize) or a map
    function changes variables as it runs, a RuntimeWarning says what moved on.

    Args:
        model: keras.Model, compiled.
        data: arrays as `fit()` takes them, batched as `fit()` batches them:
            `(x, y)` or `(x, y, sample_weight)`; `x` alone or `(x,)` for a
            model trained with `fit(x)` (a VAE, a GAN), whose `train_step`
            then gets the batch of `x` itself, as from `fit(x)`. Or a
            `tf.data.Dataset` of batches, whose elements `train_step` gets
            as they are (repeated if shorter than `steps`).
        steps: int, training steps per run (at least 2); at least twice the
            largest `steps_per_execution`, so each run has a timed call after
            the first.
        batch_size: int or None, for arrays (default 32); None for a Dataset.
        modes: str or sequence of str, among "eager", "graph", "xla".
        steps_per_execution: int or sequence of int, the second axis; None
            (the default) takes 1 and 8, keeping those that `steps` allows.

    Returns:
        pandas.DataFrame, one row per (mode, steps_per_execution): `mode`,
        `steps_per_execution`, `trace_seconds` (what the first call costs
        beyond a later one: tracing and compiling; near 0 in eager),
        `step_ms` (median per step over the later full calls),
        `steps_per_second`, `speedup_vs_eager` (against eager at the smallest
        steps_per_execution), `max_loss_diff` (largest gap to the eager
        run's reported loss at the same step), `traces` (times train_step was
        traced; 0 in eager, which runs it as Python every step), `bound_by`
        ("model" or "data": the slower of the training steps and the input) and
        `error` (why a mode could not run, else None).
        `frame.attrs["data_batches_per_second"]` is the input's rate alone and
        `frame.attrs["bottleneck"]` a one-line verdict.

    Raises:
        ValueError: at the call, for arrays fit() would refuse or fail on
            (no targets for Keras' own train_step, NumPy strings, labels
            outside a sparse loss's classes, unequal lengths), naming the
            input and the fix. Keras' own error for a Dataset the model
            cannot take keeps its type and gains a note that names them.

    Example:

    ```python
    frame = lab.compare_modes(model, (x, y), steps=32, batch_size=64)
    frame[["mode", "steps_per_execution", "step_ms", "speedup_vs_eager"]]
    frame.attrs["bottleneck"]
    ```
    """
    check_compiled(model)
    if isinstance(modes, str):
        modes = [modes]  # one mode, not its letters
    if modes is None or not isinstance(modes, collections.abc.Iterable):
        raise TypeError(f"modes must be a mode or a list of modes among {list(MODES)}, got {modes!r}: "
                        "modes=['graph', 'xla'].")
    modes = list(modes)
    for mode in modes:
        check_mode(mode)
    if batch_size is not None:
        check_number("lab.compare_modes", "batch_size", batch_size, numbers.Integral, lambda v: v >= 1,
                     "a whole number of samples, 1 or more (or None: 32 for arrays)", "batch_size=64")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise TypeError(f"steps must be an int (training steps per run), got {steps!r}.")
    if steps < 2:
        raise ValueError(f"steps={steps} is too few: use at least 2, so each run has a timed call after its first.")
    if steps_per_execution is None:
        steps_per_execution = [n for n in (1, 8) if 2 * n <= steps]
    elif isinstance(steps_per_execution, (int, np.integer)) and not isinstance(steps_per_execution, bool):
        steps_per_execution = [steps_per_execution]
    elif not isinstance(steps_per_execution, collections.abc.Iterable) or isinstance(steps_per_execution, str):
        raise TypeError(f"steps_per_execution must be an int or a list of ints, got {steps_per_execution!r}: "
                        "steps_per_execution=[1, 8].")
    spes = [check_steps_per_execution(n) for n in steps_per_execution]
    if not modes or not spes:
        raise ValueError("Give at least one mode and one steps_per_execution.")
    if steps < 2 * max(spes):
        raise ValueError(
            f"steps={steps!r} is too few for steps_per_execution={max(spes)}: use at least {2 * max(spes)} "
            "(twice the largest steps_per_execution) so each run has a timed call after its first, "
            "or leave steps_per_execution=None to take what steps allows."
        )
    if is_training(model):
        raise RuntimeError("compare_modes cannot run while fit() trains this model; call it when training is done.")
    if not isinstance(data, tf.data.Dataset):
        check_arrays_for("lab.compare_modes", model, tuple(data) if isinstance(data, list) else data, batch_size)
    streams = _RandomStreams()
    try:
        batches, data_rate = _batches_and_rate(_dataset(data, batch_size), steps)
        first = next(iter(batches))
        try:
            created = _build(model, first)
        except Exception as error:
            # Keras' words for data the model cannot take name neither the input nor the fix.
            problem = problem_with_batch(model, *keras.utils.unpack_x_y_sample_weight(first))
            if problem is not None:
                add_note(error, f"lab.compare_modes: {problem.message} Fix: {problem.fix} {INSPECT_POINTER}")
            raise
        state = _State(model, created)
        rows, losses = [], []
        try:
            for mode in modes:
                for spe in spes:
                    state.restore_values()
                    row, run_losses = _time_run(model, mode, spe, batches, steps)
                    rows.append(row)
                    losses.append(run_losses)
        finally:
            state.restore()
    finally:
        streams.restore()
    return _comparison_frame(rows, losses, data_rate)


def _build(model, batch):
    """Creates every variable a step needs before the timed runs (a train
    function cannot create variables after its first trace).

    Like `fit()` under a strategy, an unbuilt model is built symbolically from
    one batch. A model Keras cannot build that way (one with no `call()`, such
    as a GAN or VAE that only overrides `train_step`), and an unbuilt optimizer
    that `fit()` would build in its trace (no strategy: on the variables the
    step applies, where a symbolic build takes every trainable one), are built
    by one eager step, whose effect is then undone: the variables it created
    are put back to their initial values by `_State`. Returns those
    (variable, initial).
    """
    optimizer = getattr(model, "optimizer", None)
    if fit_builds_first(model) or optimizer is None or optimizer.built:
        try:
            symbolic_build(model, batch)
            return []
        except Exception:  # noqa: BLE001 - Keras' "Unable to automatically build the model"
            pass
    created = []

    def record(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created.append((variable, np.array(variable.numpy(), copy=True)))
        return variable

    before = _State(model)
    with tf.variable_creator_scope(record):
        model.train_step(batch)
    before.restore_values()
    for variable, initial in created:
        variable.assign(initial)
    return created


def _dataset(data, batch_size):
    """`data` as the Dataset of batches `fit()` would train on."""
    if isinstance(data, tf.data.Dataset):
        if batch_size is not None:
            raise ValueError("batch_size is for arrays; a Dataset is already batched: pass batch_size=None.")
        # Timed in part and over again: a copy, so that the fit() after reads what it would have.
        copy, notes, caches = reading_copy(data)
        for note in notes:
            warnings.warn(f"compare_modes: {note}", RuntimeWarning, stacklevel=3)
        read_through(copy, caches)
        return copy
    if isinstance(data, (tuple, list)):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                f"data is a {type(data).__name__} of {len(data)}; pass (x, y) or (x, y, sample_weight) as "
                "fit(x, y) takes them, x alone (or (x,)) for a model trained with fit(x), or a batched "
                "tf.data.Dataset."
            )
        x, y, sample_weight = (tuple(data) + (None, None))[:3]
    elif isinstance(data, dict) or hasattr(data, "shape"):
        x, y, sample_weight = data, None, None
    else:
        raise ValueError(
            f"data must be arrays or a tf.data.Dataset, got {type(data).__name__}: pass (x, y) or "
            "(x, y, sample_weight) as fit(x, y) takes them, x alone for a model trained with fit(x), "
            "or wrap the input in a batched tf.data.Dataset."
        )
    return array_batches(x, y, sample_weight, batch_size=batch_size or 32)


def _batches_and_rate(dataset, steps):
    """The first `steps` batches of `dataset`, cached, and the input's batches/s."""
    rate = _input_rate(dataset)
    batches = dataset.repeat().take(steps).cache()
    for _ in batches:  # fill the cache: every run then reads the same batches from memory
        pass
    return batches, rate


# Each timing of the input takes at least this long (seconds), so that the
# clock's jitter and a call's fixed cost (a fraction of a millisecond) stay
# small beside it; the search for that length settles after _RATE_BUDGET.
_RATE_WINDOW = 0.02
_RATE_BUDGET = 1.0
_RATE_SAMPLES = 3


@tf.function
def _pull(iterator, n):
    """Takes `n` batches from `iterator` inside TensorFlow, as a train function takes them."""

    def take_one(i):
        with tf.control_dependencies(tf.nest.flatten(iterator.get_next(), expand_composites=True)):
            return i + 1

    return tf.while_loop(lambda i: i < n, take_one, [tf.constant(0, tf.int64)])


def _input_rate(dataset):
    """Batches per second `dataset` yields once started, taken from one
    iterator inside TensorFlow as the train function takes them (a Python
    loop over the dataset would add its own per-batch cost).

    A sample times n and 2n batches back to back and keeps the difference,
    which cancels a call's fixed cost. n grows until one sample takes
    `_RATE_WINDOW` seconds; the rate is then the median of `_RATE_SAMPLES`
    samples at that n, so a stall of the machine during one timing decides
    nothing (and if it made n look long enough, n grows on).
    """
    iterator = iter(dataset.repeat())
    try:
        _pull(iterator, tf.constant(1, tf.int64))  # traces and starts the pipeline, outside the timing
    except tf.errors.OutOfRangeError:
        raise ValueError("data yielded no batches.") from None

    def sample(n):
        start = time.perf_counter()
        _pull(iterator, tf.constant(n, tf.int64))
        middle = time.perf_counter()
        _pull(iterator, tf.constant(2 * n, tf.int64))
        end = time.perf_counter()
        return (end - middle) - (middle - start), end - middle

    n, began = 1, time.perf_counter()
    while True:
        samples = [sample(n)]
        settled = time.perf_counter() - began > _RATE_BUDGET or n >= 2 ** 20
        if samples[0][0] >= _RATE_WINDOW or settled:
            samples += [sample(n) for _ in range(_RATE_SAMPLES - 1)]
            extra = statistics.median(extra for extra, _ in samples)
            if extra >= _RATE_WINDOW / 2 or settled:
                break
        else:
            extra = samples[0][0]
        n *= 2 if extra <= 0 else min(64, max(2, math.ceil(_RATE_WINDOW / extra)))
    if extra > 0:
        return n / extra
    return 2 * n / statistics.median(long for _, long in samples)


def _time_run(model, mode, spe, batches, steps):
    row = {"mode": mode, "steps_per_execution": spe, "trace_seconds": float("nan"), "step_ms": float("nan"),
           "traces": 0, "error": None}
    losses = {}
    try:
        if mode == "xla":
            check_xla(model)
        set_attributes(model, mode, spe)
        function, traces, restore = _counted_train_function(model)
        try:
            row, losses = _timed_calls(function, model, batches, spe, steps, row, traces, mode)
        finally:
            restore()
    except ModeError as error:
        row["error"] = str(error)
    except END_OF_DATA:
        raise
    except Exception as error:  # noqa: BLE001 - one mode failing must not hide the others
        text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        if mode == "xla":
            text += " " + XLA_COMPILE_HINT
        row["error"] = text
        losses = {}
    return row, losses


def _timed_calls(function, model, batches, spe, steps, row, traces, mode):
    """Calls the train function `steps` times: the first call, then timed ones."""
    losses = {}
    iterator = iter(_distributed(model, batches))
    start = time.perf_counter()
    logs = function(iterator)
    done = min(spe, steps)
    losses[done] = _loss(logs)
    row["trace_seconds"] = time.perf_counter() - start
    per_step = []
    while done < steps:
        start = time.perf_counter()
        logs = function(iterator)
        loss = _loss(logs)
        elapsed = time.perf_counter() - start
        count = min(spe, steps - done)
        done += count
        losses[done] = loss
        if count == spe:
            per_step.append(elapsed / spe)
    row["step_ms"] = 1000.0 * statistics.median(per_step)
    # What the first call costs beyond a later full one: tracing, compiling.
    row["trace_seconds"] = max(0.0, row["trace_seconds"] - statistics.median(per_step) * spe)
    row["traces"] = 0 if mode == "eager" else traces[0]
    return row, losses


def _counted_train_function(model):
    """A fresh train function whose train_step counts its Python runs (traces)."""
    traces = [0]
    owner = _TraceCounter()
    hooks = hooks_for(model)

    def counter(step):
        def counted(data):
            traces[0] += 1
            return step(data)

        return counted

    # Newer Keras reads model.train_step once, when the function is built;
    # Keras before 3.7 reads it when the step is traced. So the counter stays
    # on until the run is over (`restore`).
    hooks.wrap(owner, model, "train_step", counter, role="counter")

    def restore():
        hooks.release(owner)

    try:
        model.make_train_function(force=True)
    except BaseException:
        restore()
        raise
    return model.train_function, traces, restore


class _TraceCounter:
    """The owner of compare_modes' trace counter in the instrumentation layer."""


def _distributed(model, batches):
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync > 1:
        return strategy.experimental_distribute_dataset(batches)
    return batches


def _loss(logs):
    value = logs.get("loss") if isinstance(logs, dict) else None
    return float(value) if value is not None else float("nan")  # float() waits for the device


class _State:
    """Copies of a model's variables and settings, restored after comparing.

    Every tf.Variable the model holds is copied (see `held_variables`:
    optimizers in a list, a step counter, a `tf.random.Generator`'s state
    too), and under a tf.distribute strategy each replica's copy of it, so
    that per-replica values (BatchNormalization's moving statistics under
    MirroredStrategy) are each put back as they were.
    """

    def __init__(self, model, created=()):
        self.model = model
        variables, seen = [], set()
        optimizers = find_optimizers(model).values()
        groups = [model.variables, model.metrics_variables] + [o.variables for o in optimizers]
        groups.append([variable for variable, _ in created])
        groups.append(held_variables(model).values())
        for group in groups:
            for variable in group:
                variable = raw_variable(variable)
                if id(variable) not in seen:
                    seen.add(id(variable))
                    variables.append(variable)
        self.copies = [copy for v in variables for copy in replica_copies(v)]
        self.values = [np.array(copy.numpy(), copy=True) for copy in self.copies]
        self.settings = Settings(model)

    def restore_values(self):
        for copy, value in zip(self.copies, self.values):
            copy.assign(value)

    def restore(self):
        self.restore_values()
        self.settings.restore(self.model)


class _RandomStreams:
    """The random streams a training step draws from, as they were before comparing.

    Python's and NumPy's global generators, Keras' SeedGenerator for
    unseeded `keras.random` draws and TensorFlow's global
    `tf.random.Generator` are copied and put back; one made while comparing
    is taken away again, so the next step makes it as it would have.
    TensorFlow's op seeds for eager random ops are another matter: each
    such op takes a seed from a stream, and TensorFlow keeps a kernel per
    seed whose numbers go on from where they stopped. Putting that stream
    back would give the next `fit()` the same seeds again, with kernels the
    comparison has advanced; so the comparison draws from a stream of its
    own, and TensorFlow's is never touched.
    """

    def __init__(self):
        self.python = random.getstate()
        self.numpy = np.random.get_state()
        self.keras = keras_global_seed_generator()
        self.keras_state = None if self.keras is None else np.array(self.keras.state.numpy(), copy=True)
        self.tf_generator = tf_global_generator()
        self.tf_state = None if self.tf_generator is None else np.array(self.tf_generator.state.numpy(), copy=True)
        self.eager_seeds = eager_op_seeds()
        if self.eager_seeds is not None:
            # A stream of its own, the same for the same state, whose seeds
            # meet those TensorFlow's gives next no more often than two of
            # TensorFlow's own meet.
            set_eager_op_seeds(random.Random(f"lab.compare_modes {self.eager_seeds.getstate()}"))

    def restore(self):
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        set_keras_global_seed_generator(self.keras)
        if self.keras is not None:
            self.keras.state.assign(self.keras_state)
        tf.random.set_global_generator(self.tf_generator)
        if self.tf_generator is not None:
            self.tf_generator.state.assign(self.tf_state)
        if self.eager_seeds is not None:
            set_eager_op_seeds(self.eager_seeds)


def _comparison_frame(rows, losses, data_rate):
    frame = pd.DataFrame(rows, columns=["mode", "steps_per_execution", "trace_seconds", "step_ms", "traces", "error"])
    frame["steps_per_second"] = 1000.0 / frame["step_ms"]
    reference = _reference_index(frame)
    if reference is None:
        frame["speedup_vs_eager"] = float("nan")
        frame["max_loss_diff"] = float("nan")
    else:
        frame["speedup_vs_eager"] = frame.loc[reference, "step_ms"] / frame["step_ms"]
        base = losses[reference]
        frame["max_loss_diff"] = [_max_gap(base, run) for run in losses]
    frame["bound_by"] = np.where(data_rate < frame["steps_per_second"], "data", "model")
    frame["error"] = frame["error"].astype(object).where(frame["error"].notna(), None)
    frame.loc[frame["error"].notna(), "bound_by"] = None
    frame = frame[["mode", "steps_per_execution", "trace_seconds", "step_ms", "steps_per_second",
                   "speedup_vs_eager", "max_loss_diff", "traces", "bound_by", "error"]]
    frame.attrs["data_batches_per_second"] = data_rate
    frame.attrs["bottleneck"] = bottleneck(frame, data_rate)
    return frame


def _reference_index(frame):
    eager = frame[(frame["mode"] == "eager") & frame["error"].isna()]
    if eager.empty:
        return None
    return eager["steps_per_execution"].idxmin()


def _max_gap(base, run):
    common = sorted(set(base) & set(run))
    if not common:
        return float("nan")
    return max(abs(run[k] - base[k]) for k in common)


