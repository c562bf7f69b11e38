"""Keras / TensorFlow version differences, decided once from the installed versions.

Every Keras internal the lab relies on that moved between the supported
releases (Keras 3.5 to 3.15) is named here, with the release it changed in,
so no other module reads Keras' source or guesses from behaviour. The tests
of this module run at both ends of the supported range (`make test-oldest`).
"""

import collections
import contextlib
import inspect
import re
import sys
import threading
import warnings

import keras
import tensorflow as tf

# TensorFlow's XLA optimization barrier (`XlaOptimizationBarrier`, in
# `tensorflow/compiler/tf2xla/ops` since TF 2.9, not in tf.raw_ops) and its
# test for an XLA trace (`control_flow_util.GraphOrParentsInXlaContext`: a
# `jit_compile` function and what is traced inside it); both in TF 2.16 and 2.21.
from tensorflow.compiler.tf2xla.ops.gen_xla_ops import (
    xla_optimization_barrier as _xla_barrier,
)
from tensorflow.python.ops.control_flow_util import (
    GraphOrParentsInXlaContext as _in_xla_context,
)
# Whether a SavedModel is being written (TF 2.16 and 2.21), where a call-time
# capture gives its default value.
from tensorflow.python.saved_model.save_context import in_save_context as _in_save_context
# The graphs of a tf.cond's branches and a tf.while_loop's body and condition
# (TF 2.16 and 2.21).
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

# The TensorFlow part reads it as compat.error_line; it knows no backend (lab/error_text.py).
from lab.error_text import error_line  # noqa: E402, F401


def _version(text):
    """(major, minor, patch) from a version string; "3.10.0rc1" -> (3, 10, 0)."""
    parts = [int(match.group()) if match else 0
             for match in (re.match(r"\d+", piece) for piece in text.split(".")[:3])]
    return tuple(parts + [0] * (3 - len(parts)))


KERAS_VERSION = _version(keras.__version__)
TF_VERSION = _version(tf.__version__)

# XLA for a CPU in TF 2.19 and 2.21 compiles a whole tensor's sum
# (`tf.nn.l2_loss`) to a loop two to three times slower than the same sum
# taken over 4 columns first (a column sum it vectorizes), where TF 2.16-2.18
# compile the whole sum five times faster than the columns and TF 2.20 about
# as fast (65,536 float32, one CPU); and the norms' overflow check, a
# conditional over the step's gradients, costs about 100 us a step inside
# Keras' execution loop in TF 2.21, against about 6 in TF 2.16 (the
# benchmark MLP; `slow_xla_cpu_trace`, and benchmarks/README.md, "Norms
# under XLA").
SLOW_XLA_CPU_REDUCTIONS = TF_VERSION[:2] in ((2, 19), (2, 21))

# Keras 3.8 scales each replica's loss by 1/replicas inside compute_loss
# (`keras/src/losses/loss.py`, `scale_loss_for_distribution`); before, the
# loss a replica returns is its own mean.
SCALES_LOSS_BY_REPLICAS = KERAS_VERSION >= (3, 8)

# Keras 3.11's fit() passes the last step of an execution to
# on_train_batch_end (`for begin_step, end_step, iterator in epoch_iterator`);
# before, it passes the first step, also at steps_per_execution > 1.
BATCH_END_REPORTS_LAST_STEP = KERAS_VERSION >= (3, 11)

# fit(shuffle=True) on a PyDataset of known length shuffles its batch indices
# each epoch with Python's `random.shuffle` (PyDatasetAdapter); before Keras
# 3.6 its tf.data pipeline also passed the batches through `shuffle(8)`, a
# buffer drawn from TensorFlow's seed, that only fit()'s own dataset replays.
PYDATASET_SHUFFLE_IS_PYTHON_RANDOM = KERAS_VERSION >= (3, 6)

# fit() resets its epoch iterator before the first epoch, and the reset ends
# an epoch of the data: a PyDataset's on_epoch_end runs once before any batch
# (Keras 3.7 on; a PyDataset that shuffles its samples there, as keras-io's
# do, trains its first epoch in that shuffled order).
FIT_ENDS_AN_EPOCH_BEFORE_THE_FIRST = KERAS_VERSION >= (3, 7)



def steps_in_execution(begin, end, steps_per_execution, total=None):
    """How many steps the execution ran that Keras numbered `begin` at its
    batch begin and `end` at its batch end: Keras 3.11+ passes the span
    (a last, partial execution by its full span, cut here at `total`, the
    epoch's steps where known); before, the same number twice."""
    if end > begin or BATCH_END_REPORTS_LAST_STEP:
        steps = max(1, end - begin + 1)
    else:
        steps = int(steps_per_execution or 1)
    if total:
        steps = max(1, min(steps, int(total) - begin))
    return steps


# Keras before 3.7 runs an execution of steps_per_execution > 1 as a Python
# loop of `next(iterator)` calls in one tf.function (3.7 made it a
# `tf.while_loop` over `get_next_as_optional`). Where the data ends inside an
# execution, graph mode still runs the part of the step after the last batch
# that needs no batch: bare fit() over 3 batches at steps_per_execution=2
# counted 4 optimizer iterations. Hooks that put the update behind what needs
# the batch change that part (`Recorder._note_short_execution`).
SHORT_EXECUTION_RUNS_PART_OF_A_STEP = KERAS_VERSION < (3, 7)

# Keras 3.7's make_train_function binds `self.train_step` when it builds the
# function (`self._make_function(self.train_step)`); before, the step is
# looked up on the model when the function is traced.
TRAIN_STEP_BOUND_AT_BUILD = KERAS_VERSION >= (3, 7)

if SCALES_LOSS_BY_REPLICAS:
    from keras.src.losses.loss import unscale_loss_for_distribution
else:
    def unscale_loss_for_distribution(value):
        """Keras before 3.8 does not scale the loss: nothing to undo."""
        return value


class LossScalingSeen:
    """What Keras' distribution loss scaling did on this thread while a
    probe traced (or ran) one train_step: `scaled`, the values a Keras loss
    object returned scaled by 1/replicas (Keras 3.8+, `reduce_values` and the
    trainer's additional losses, both through
    `keras.src.losses.loss.scale_loss_for_distribution`), and `unscaled`, how
    many values Keras' own step scaled back (`unscale_loss_for_distribution`).
    A step that calls a loss object itself (keras-io's "going lower-level"
    step) and feeds its loss tracker that value logs 1/replicas of the
    batch's loss; Keras' own step unscales first. Keras hands the scaled
    value to no hook of the model's, so the two module functions are wrapped,
    for the length of the step's call only, by `watch_loss_scaling`: the
    wrappers count on the thread that opened the window and pass every other
    call through unchanged; the last window to close puts Keras' functions
    back. Keras before 3.8 scales nothing: there the window wraps nothing.
    """

    def __init__(self):
        self.scaled = []
        self.unscaled = 0


_scaling_lock = threading.Lock()
_scaling_windows = threading.local()
_scaling_open = [0, None]  # windows open on every thread, Keras' own (scale, unscale)


def _scaling_wrappers(scale, unscale):
    def scale_loss_for_distribution(value):
        result = scale(value)
        seen = getattr(_scaling_windows, "seen", None)
        if seen is not None and result is not value:
            seen.scaled.append(result)
        return result

    def unscale_loss_for_distribution(value):
        seen = getattr(_scaling_windows, "seen", None)
        if seen is not None:
            seen.unscaled += 1
        return unscale(value)

    return scale_loss_for_distribution, unscale_loss_for_distribution


@contextlib.contextmanager
def watch_loss_scaling(seen):
    """Counts into `seen` (a `LossScalingSeen`) what Keras' loss scaling
    does on this thread inside the block; see `LossScalingSeen`."""
    if not SCALES_LOSS_BY_REPLICAS:
        yield seen
        return
    from keras.src.losses import loss as loss_module

    with _scaling_lock:
        if _scaling_open[0] == 0:
            own = (loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution)
            wrappers = _scaling_wrappers(*own)
            loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution = wrappers
            _scaling_open[1] = (own, wrappers)
        _scaling_open[0] += 1
    outer = getattr(_scaling_windows, "seen", None)
    _scaling_windows.seen = seen
    try:
        yield seen
    finally:
        _scaling_windows.seen = outer
        with _scaling_lock:
            _scaling_open[0] -= 1
            if _scaling_open[0] == 0:
                own, wrappers = _scaling_open[1]
                _scaling_open[1] = None
                # Put Keras' own back unless someone replaced ours meanwhile.
                if loss_module.scale_loss_for_distribution is wrappers[0]:
                    loss_module.scale_loss_for_distribution = own[0]
                if loss_module.unscale_loss_for_distribution is wrappers[1]:
                    loss_module.unscale_loss_for_distribution = own[1]


def fit_builds_first(model):
    """True where `fit()` builds the model, its metrics and its optimizer from
    one batch before the first step: under a distribution strategy
    (`Trainer._maybe_symbolic_build`, all supported releases). Elsewhere the
    train function's trace builds them, and the optimizer is built on the
    variables the step applies, not on every trainable one."""
    return getattr(model, "_distribute_strategy", None) is not None


def symbolic_build(model, data_batch):
    """Builds an unbuilt model, its metrics and optimizer from one batch, as
    `fit()` does under a strategy (`Trainer._symbolic_build`, all supported
    releases). Raises what Keras raises for a model it cannot build that way
    (one without `call()`, such as a GAN that only overrides `train_step`)."""
    model._symbolic_build(data_batch=data_batch)


def calling_callback_list(depth=2, reach=6):
    """The `keras.callbacks.CallbackList` whose `set_model` is calling the caller.

    Keras hands a callback no reference to the CallbackList that calls it,
    and only that list sees an exception raised between callbacks (another
    callback failing, an interrupt between batches). In every supported
    release `CallbackList.set_model` calls each callback's `set_model`
    directly, so the list is a few frames up. The lab reads frames to find
    Keras objects here, in `calling_model_call`, `called_from` and in
    `tracing_tf_function`, all in this module. Returns None when called otherwise.
    """
    frame = sys._getframe(depth)
    for _ in range(reach):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            return owner
        frame = frame.f_back
    return None


def calling_model_call(model, depth=2, reach=12):
    """`(name, frame)` of the `model.fit()`, `evaluate()` or `predict()`
    call that is calling the caller (a callback's `set_model`), or
    `(None, None)`.

    A recorder attaches to a fit() only: evaluate() and predict() train
    nothing. An exception raised by fit()'s own code between its steps and
    its callbacks (its metrics' results at an epoch's end, a train function
    a callback's `compile()` took away, an interrupt between two lines)
    reaches no callback: whether that fit() still runs is whether its frame
    is still on its thread's stack (`frame_on_stack`). In every supported
    release these methods build their CallbackList, which calls
    `set_model`, in their own frame, a few frames up.
    """
    frame = sys._getframe(depth)
    for _ in range(reach):
        if frame is None:
            break
        if frame.f_code.co_name in ("fit", "evaluate", "predict") and frame.f_locals.get("self") is model:
            return frame.f_code.co_name, frame
        frame = frame.f_back
    return None, None


def called_from(frame, depth=2):
    """Whether the caller's caller runs in `frame`. In every supported
    release `fit()` calls `self.train_function(iterator)` in its own frame,
    and `train_on_batch()` in its own: a train function called from
    anywhere else than the fit() a recorder records is run by another
    caller (a `fit()` or `train_on_batch()` inside a callback)."""
    return sys._getframe(depth) is frame


def is_fits_validation(kwargs):
    """Whether an `evaluate()` call with these keyword arguments is the one
    `fit()` makes for its validation data: every supported release (3.5 to
    3.15) passes it the private `_use_cached_eval_dataset=True`."""
    return bool(kwargs.get("_use_cached_eval_dataset", False))


def fits_epoch_iterator(frame):
    """The epoch iterator of the `fit()` running in `frame`, or None.

    In every supported release `fit()` makes its `TFEpochIterator` (a local,
    `epoch_iterator`) before its CallbackList, and runs each epoch's batches
    inside `with epoch_iterator.catch_stop_iteration():`, looked up on the
    instance: the one place that sees every exception of that loop
    (making the data's iterator, reading a batch, fit()'s own lines).
    """
    iterator = frame.f_locals.get("epoch_iterator")
    return iterator if callable(getattr(iterator, "catch_stop_iteration", None)) else None


def fits_calls_between_steps(model):
    """`(target, name)` of the methods `fit()` calls between its epochs'
    loops, outside every callback (every supported release): the metrics'
    reset at an epoch's start, their results at its end, and the
    optimizer's `finalize_variable_values` at fit()'s end."""
    calls = [(model, name) for name in ("reset_metrics", "_get_metrics_result_or_logs")
             if callable(getattr(model, name, None))]
    optimizer = getattr(model, "optimizer", None)
    if callable(getattr(optimizer, "finalize_variable_values", None)):
        calls.append((optimizer, "finalize_variable_values"))
    return calls


def frame_on_stack(frame, thread_id):
    """Whether `frame` is still running on the thread `thread_id`."""
    top = sys._current_frames().get(thread_id)
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def tracing_tf_function(describe=repr, depth=2):
    """The `tf.function` whose trace is calling the caller, and its call's
    arguments (name -> `describe(value)`), or None outside a trace.

    TensorFlow hands traced Python code no handle on the function being
    traced; its `__call__` frame holds it (as `self`, with `args` and `kwds`)
    in every supported release. Used only to explain retracing.
    """
    frame = sys._getframe(depth)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, tf.types.experimental.PolymorphicFunction) and "args" in frame.f_locals:
            args, kwargs = frame.f_locals["args"], frame.f_locals.get("kwds") or {}
            try:
                bound = inspect.signature(owner.python_function).bind(*args, **kwargs)
                arguments = dict(bound.arguments)
            except (TypeError, ValueError, AttributeError):
                arguments = {f"#{i}": a for i, a in enumerate(args)} | dict(kwargs)
            return owner, {name: describe(value) for name, value in arguments.items()}
        frame = frame.f_back
    return None


def function_mode(function, reach=6):
    """The mode Keras made a train (test, predict) function in: "eager",
    "graph" or "xla"; None when it cannot be told (not Keras' own).

    Keras reads `run_eagerly` and `jit_compile` once, when
    `make_train_function` makes the function, and keeps it when the
    attributes are set again by hand. Both Keras 3.5 and 3.15 make a plain
    Python function (3.15) or `tf.function` (3.5) whose closures hold the
    step's `tf.function`s, with the step's `jit_compile` on the innermost;
    an eager function holds none.
    """
    flags = _closure_jit_flags(function, reach, set())
    if flags:
        return "xla" if any(flags) else "graph"
    if getattr(function, "__module__", "").startswith("keras."):
        return "eager"
    return None


def _closure_jit_flags(function, reach, seen):
    """The `jit_compile` of each tf.function in `function` or its closures."""
    if reach < 0 or id(function) in seen:
        return []
    seen.add(id(function))
    flags = []
    if isinstance(function, tf.types.experimental.PolymorphicFunction):
        flags.append(bool(getattr(function, "_jit_compile", False)))
        function = getattr(function, "python_function", None)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if isinstance(value, tf.types.experimental.PolymorphicFunction) or inspect.isfunction(value):
            flags += _closure_jit_flags(value, reach - 1, seen)
    return flags


def in_xla_trace():
    """Whether the code running is being traced into an XLA program."""
    return not tf.executing_eagerly() and bool(_in_xla_context(tf.compat.v1.get_default_graph()))


def slow_xla_cpu_trace():
    """Whether the program being traced is an XLA program for the host's
    CPU in a release that compiles whole sums and conditionals slowly
    (`SLOW_XLA_CPU_REDUCTIONS`): there the lab sums large tensors over
    columns and leaves its norms for the host to finish, as outside XLA.
    Not with a GPU or TPU present, where the step may compile for it (on a
    TPU a 4-wide minor dimension is padded to 128)."""
    return in_xla_trace() and _slow_xla_here()


def xla_keeps_overflowing_norms():
    """Whether a step compiled with `jit_compile=True` here computes a norm
    whose sum of squares overflows float32 exactly (its overflow check);
    not on a CPU alone with TF 2.19 or 2.21 (`slow_xla_cpu_trace`)."""
    return not _slow_xla_here()


def _slow_xla_here():
    return (SLOW_XLA_CPU_REDUCTIONS and not tf.config.list_logical_devices("GPU")
            and not tf.config.list_logical_devices("TPU"))


def isolated(tensors):
    """`tensors` (None entries kept) as the lab's own computations must read
    them: inside an XLA trace, through one optimization barrier; elsewhere
    as they are.

    XLA compiles the training step and the lab's reads of it into one
    program. Without a barrier it may merge the lab's `g * g` (a norm) with
    the optimizer's (Adam's second moment), or fuse them, and then round the
    optimizer's own computation differently: a GAN's weights came out an
    ulp apart from a bare fit. The barrier's outputs are the same values;
    nothing before it can be fused with, or merged into, what reads them.
    """
    tensors = list(tensors)
    if not in_xla_trace():
        return tensors
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return tensors
    passed = _xla_barrier([tf.convert_to_tensor(tensors[i]) for i in present])
    for i, tensor in zip(present, passed):
        tensors[i] = tensor
    return tensors


# Elementwise arithmetic that Grappler's arithmetic optimizer regroups (a
# product of a product, a sum of sums) where the inner result has one reader.
_REGROUPED = frozenset({"Mul", "Add", "AddV2", "AddN", "Sub", "Neg", "RealDiv", "Div"})
_PASSED_ON = frozenset({"Identity", "IdentityN", "Snapshot"})


def regrouped_through(gradient):
    """Whether TensorFlow's graph optimizer (Grappler) may compute the
    update made of graph tensor `gradient` differently once the lab reads
    it (`gradient`'s optimizer ops already built, the lab's reads not yet).

    Grappler regroups elementwise arithmetic across an intermediate result
    only while that result has one reader: BatchNormalization's gamma
    gradient is a product, and plain SGD's `gradient * learning_rate` is
    its one reader, so a bare step computes `a * (b * learning_rate)`; a
    second reader (a norm) keeps `(a * b) * learning_rate`, an ulp apart
    (seen with TF 2.16-2.21; Adam reads a gradient twice, and nothing
    changes). So: a gradient made by such arithmetic (seen through the
    Identity ops the tape adds, and into the step from a cond branch the
    lab's breakpoints put the update in), read by one such op alone, or by
    copies of one (the same op on the same inputs, which Grappler merges
    before it regroups).
    Eager execution and XLA (whose own case `lab.backend.tensorflow.probes.XLA_NOTE` covers)
    are never regrouped by Grappler."""
    if tf.executing_eagerly() or in_xla_trace() or not hasattr(gradient, "consumers"):
        return False
    readers = _distinct(gradient.consumers())
    if len(readers) != 1 or readers[0].type not in _REGROUPED:
        return False
    made = gradient
    while True:
        if made.op.type in _PASSED_ON and made.op.inputs:
            made = made.op.inputs[made.value_index if made.op.type == "IdentityN" else 0]
        elif made.op.type == "Placeholder" and _captured(made) is not None:
            made = _captured(made)
        else:
            return made.op.type in _REGROUPED


def _distinct(ops):
    """`ops` less those that repeat an earlier one's type and inputs: Grappler
    computes such repeats once (SGD with nesterov momentum multiplies the
    gradient by the learning rate twice), so they are one reader."""
    seen, distinct = set(), []
    for op in ops:
        key = (op.type, tuple(tensor.ref() for tensor in op.inputs))
        if key not in seen:
            seen.add(key)
            distinct.append(op)
    return distinct


def _captured(tensor):
    """The outer tensor that function-graph input `tensor` captures (a cond branch's input), or None."""
    for external, internal in getattr(tensor.graph, "captures", ()):
        if internal is tensor:
            return external
    return None


def rarely(usual, condition, branch, inputs):
    """`usual()` where the scalar bool `condition` holds, else
    `branch(inputs)`: a `tf.cond` for a branch that rarely runs, over many
    inputs, at the least cost to the graph around it.

    A graph runs a lowered `tf.cond` as Switch and Merge nodes, one Switch
    for each tensor a branch reads: with every norm of a 50-variable update
    in one overflow check (150 tensors), those Switches cost more than the
    norms. Where the graph has no control flow of its own (the usual
    training step, not inside a loop or a cond), this is one functional `If`
    node that is not lowered (`functional_cond`), its inputs passed to the
    side it runs as they are. Measured on the benchmark MLP's `train_step`
    with a probe's gradient norms (4,000 steps interleaved with the bare
    step's, one CPU, 2026-12-02): 74 us a step over the bare step, against
    91 us with the Switch form below and 51 us with no check at all.

    Inside a `tf.while_loop` or a cond, whose Switches are there anyway,
    one Switch decides: its output on the branch's side is the pivot the
    branch depends on (a node that depends on a dead one is dead, and does
    not run: TF1's cond, by hand), and the branch is one function call, so
    the side not taken is a single dead node. Eager execution and XLA, whose
    conds cost no Switches, take `tf.cond` as it is (under XLA, any other
    program could fuse the step's own ops differently).

    `branch` must have no side effects (ValueError): after a dead one,
    every op that must run after it would be dead too.
    """
    if tf.executing_eagerly() or in_xla_trace():
        return tf.cond(condition, usual, lambda: branch(list(inputs)))
    inputs = list(inputs)
    called = tf.function(lambda *values: branch(list(values)), autograph=False, reduce_retracing=False,
                         experimental_attributes={"_noinline": True})
    traced = called.get_concrete_function(*inputs)
    stateful = sorted({op.type for op in traced.graph.get_operations() if op.op_def.is_stateful})
    if stateful:
        raise ValueError(f"rarely() takes a branch without side effects; this one has {stateful}. Use tf.cond.")
    if not in_control_flow():
        return functional_cond(condition, usual, lambda: called(*inputs))
    taken, kept = tf.raw_ops.Switch(data=usual(), pred=condition)
    pivot = tf.identity(taken)
    with tf.control_dependencies([pivot]):
        computed = called(*inputs)
    return tf.raw_ops.Merge(inputs=[computed, kept])[0]


def light_call_time_value(graph, key, closure):
    """Makes the call-time capture `key` of `graph` (made by
    `graph.capture_call_time_value(closure, spec, key=key)`) take
    `closure()` as it is at each call from Python.

    TensorFlow evaluates a call-time capture at every call of the function
    through a wrapper that casts the value to its spec and flattens it:
    about 12 us a call timed alone on a CPU, and 20-40 us of a watched 1 ms
    MLP step timed with and without it (scratch A/B); `closure` must
    return an EagerTensor of exactly that spec, so the wrapper is skipped
    there. A call traced inside another function (not from Python) or made
    while saving goes through TensorFlow's own wrapper, which captures the
    value from the outer function, made light in turn. The capture
    container's `by_ref_external` / `add_or_replace` are the same in TF 2.16
    and 2.21.
    """
    captures = graph.function_captures
    standard = captures.by_ref_external[key]
    if getattr(standard, "light", False):
        return

    def light():
        if tf.executing_eagerly() and not _in_save_context():
            return closure()
        value = standard()
        outer = tf.compat.v1.get_default_graph()
        held = None if tf.executing_eagerly() else getattr(outer, "function_captures", None)
        if held is not None and key in held.by_ref_external:
            light_call_time_value(outer, key, closure)
        return value

    light.light = True
    captures.add_or_replace(key=key, external=light, internal=captures.by_ref_internal[key],
                            tracetype=captures.by_ref_tracetype[key], is_by_ref=True)


def in_control_flow(graph=None):
    """Whether `graph` (default: the one being built) is the body of a
    `tf.while_loop` or a branch of a `tf.cond`, or a function traced inside
    one: where a graph has Switch and Merge nodes anyway."""
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    while graph is not None:
        if isinstance(graph, ControlFlowFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def functional_cond(condition, true_fn, false_fn):
    """`tf.cond(condition, true_fn, false_fn)`, kept one functional `If`
    node in a graph (not lowered to Switch and Merge, see `rarely`); the
    branches may have side effects, ordered like any stateful op. Eager
    execution and XLA take `tf.cond` as it is."""
    if tf.executing_eagerly() or in_xla_trace():
        return tf.cond(condition, true_fn, false_fn)
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    result = tf.cond(condition, true_fn, false_fn)
    for op in graph.get_operations()[before:]:
        if op.type in ("If", "StatelessIf") and "_lower_using_switch_merge" in op.node_def.attr:
            op._set_attr("_lower_using_switch_merge", tf.compat.v1.AttrValue(b=False))
    return result


def graph_nodes(graph):
    """The nodes a graph runs, by op type (a collections.Counter), with the
    functions it calls: a cond's branches (a graph runs the nodes of the one
    not taken as dead ones) and a lowered cond's Switches, one per input of
    the If, but not the body of a function called as one node (`rarely`'s
    branch), which runs only when its call does. An If that stays one node
    (`functional_cond`) counts as an If, its branches' nodes with the rest."""
    counts, seen, graphs = collections.Counter(), set(), [graph]
    while graphs:
        graph = graphs.pop()
        for op in graph.get_operations():
            counts[op.type] += 1
            if op.type in ("If", "StatelessIf") and _lowered(op):
                counts["Switch"] += len(op.inputs) - 1
        for name, function in getattr(graph, "_functions", {}).items():
            if name not in seen and hasattr(function, "graph") and not function.definition.attr["_noinline"].b:
                seen.add(name)
                graphs.append(function.graph)
    return counts


def _lowered(op):
    """Whether a graph runs the If `op` as Switch and Merge nodes."""
    attr = op.node_def.attr.get("_lower_using_switch_merge")
    return attr is not None and attr.b


# TensorFlow's random ops whose stream lives in the kernel: a graph traced
# again makes new kernels, which start their streams again (`tf.random.normal`,
# `tf.random.uniform`, `tf.nn.dropout`, `tf.image.random_*`, ...). Keras'
# random ops (a SeedGenerator's variable) and `tf.random.Generator` keep
# their state in a variable and go on.
STATEFUL_RANDOM_OPS = frozenset((
    "RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "RandomGamma", "RandomPoisson",
    "RandomPoissonV2", "Multinomial", "RandomCrop"))


def stateful_random_ops(graph):
    """The names of the ops of `graph` (and of the functions it calls) that
    draw from a stream kept in their kernel (`STATEFUL_RANDOM_OPS`), in
    graph order."""
    found, seen, graphs = [], set(), [graph]
    while graphs:
        graph = graphs.pop(0)
        found.extend(op.name for op in graph.get_operations() if op.type in STATEFUL_RANDOM_OPS)
        for name, function in getattr(graph, "_functions", {}).items():
            if name not in seen and hasattr(function, "graph"):
                seen.add(name)
                graphs.append(function.graph)
    return found


# ---- the random streams a training step draws from ----------------------------

# Keras' unseeded `keras.random` draws (`seed=None`, also a layer's) take
# their seeds from one SeedGenerator, made on first use and kept in Keras'
# thread-local global state under this name
# (`keras.src.random.seed_generator.global_seed_generator`, Keras 3.5 to 3.15).
_KERAS_GLOBAL_SEED_GENERATOR = "global_seed_generator"


def updating_optimizers(name, optimizer):
    """The optimizers whose own update step runs where `optimizer` (held
    under `name`) is applied, each with the name its columns take: a
    LossScaleOptimizer's inner one under `name`; each of a MultiOptimizer's
    (Keras 3.12 on: its `apply` hands each its own variables) under
    `<name>/<its name>`, numbered where names repeat; else `optimizer`."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return [(name, inner)]
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is None or not isinstance(optimizer, multi):
        return [(name, optimizer)]
    found, seen = [], {}
    for part in optimizer.optimizers:
        key = f"{name}/{part.name}"
        seen[key] = seen.get(key, 0) + 1
        found.append((key if seen[key] == 1 else f"{key}#{seen[key]}", part))
    return found


def optimizer_variables_for(optimizer):
    """The model variables `optimizer` was built for, in its order (Keras'
    private `_trainable_variables`, 3.0 on); [] before it is built. A
    LossScaleOptimizer's are its inner optimizer's."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    return list(getattr(inner, "_trainable_variables", None) or ())


def optimizer_applies(optimizer):
    """How many times `optimizer` was applied (waits for the device).

    Its public `iterations` counts updates: with Keras' gradient accumulation,
    an apply that only accumulates is not one. The count of applies is the
    private `_iterations` (Keras 3.0 on), read where it exists.
    """
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    return int(getattr(inner, "_iterations", inner.iterations).numpy())


def all_layers(model, include_self=True):
    """Every layer of `model`, nested ones too, each once (Keras' private
    `_flatten_layers`, the walk `model.layers` makes one level of)."""
    return list(model._flatten_layers(include_self=include_self, recursive=True))


def forward_state_variables(layer):
    """The variables `layer` itself (not its sublayers) may assign in its
    forward pass: where the layer is trainable, the non-trainable ones it
    made (Keras' private `_non_trainable_variables`: BatchNormalization's
    moving statistics; a frozen BatchNormalization assigns none), and in
    any case a stateful RNN's recurrent state and its seed generators'
    states (Dropout's), which no frozen flag stops from moving."""
    own = list(layer._non_trainable_variables) if layer.trainable else []
    seeds = [generator.state for generator in getattr(layer, "_seed_generators", ())]
    return own + recurrent_state_variables(layer) + seeds


def recurrent_state_variables(layer):
    """The variables that hold a stateful RNN layer's state between batches
    (its `states`, made at its first call; in no `variables` list), else []."""
    states = getattr(layer, "states", None) if getattr(layer, "stateful", False) else None
    if states is None or not isinstance(layer, keras.layers.RNN):
        return []
    # A list, or (Keras 3.5) TensorFlow's tracking ListWrapper of one; its
    # variables are Keras' (whose class `keras.Variable` is not in 3.5).
    flat = tf.nest.flatten(states)
    return [v for v in flat if hasattr(v, "assign") and hasattr(v, "dtype")]


def keras_global_seed_generator():
    """Keras' SeedGenerator for unseeded `keras.random` draws on this
    thread, or None before the first such draw (no generator is made)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(_KERAS_GLOBAL_SEED_GENERATOR)


def set_keras_global_seed_generator(generator):
    """Makes `generator` Keras' SeedGenerator for unseeded draws on this
    thread; None: Keras makes a new one at the next draw, as it does first."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(_KERAS_GLOBAL_SEED_GENERATOR, generator)


def eager_op_seeds():
    """TensorFlow's stream of op seeds for eager random ops given no seed
    of their own (`tf.random.normal(...)` run eagerly after
    `tf.random.set_seed`): a `random.Random` on the eager context, made by
    `set_seed` (`context()._rng`, TF 2.16 and 2.21). None when there is
    none (no global seed: such ops are not reproducible anyway)."""
    from tensorflow.python.eager import context

    return getattr(context.context(), "_rng", None)


def set_eager_op_seeds(stream):
    """Makes the `random.Random` `stream` TensorFlow's stream of eager op
    seeds (see `eager_op_seeds`); the global seed stays as it is."""
    from tensorflow.python.eager import context

    context.context()._rng = stream


def single_copy_variable(name, initial, device):
    """A float32, untrained `tf.Variable` with one copy, on `device`, also
    when made inside a `tf.distribute` strategy's scope, where `tf.Variable`
    makes one copy per replica (a MirroredVariable). TensorFlow has no public
    way out of a scope: the variable's own class, called directly, skips the
    strategy's variable creator (`resource_variable_ops.ResourceVariable`,
    TF 2.16 and 2.21)."""
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(initial, dtype=tf.float32, trainable=False, name=name)


def tf_global_generator():
    """`tf.random.get_global_generator()` without making it: None before its
    first use (`stateful_random_ops.global_generator`, TF 2.16 and 2.21)."""
    from tensorflow.python.ops import stateful_random_ops

    return stateful_random_ops.global_generator


def array_batches(x, y=None, sample_weight=None, batch_size=32):
    """Arrays as the `tf.data.Dataset` of batches `fit(x, y, sample_weight,
    batch_size=..., shuffle=False)` trains on: Keras' own data adapter
    (`keras.src.trainers.data_adapters.get_data_adapter`, Keras 3.5 to
    3.15), so `x` alone arrives as the tensor, a list of inputs as a tuple,
    a dict as a dict, exactly as `fit()` hands them to `train_step`."""
    from keras.src.trainers.data_adapters import get_data_adapter

    adapter = get_data_adapter(x, y=y, sample_weight=sample_weight, batch_size=batch_size, shuffle=False)
    return adapter.get_tf_dataset()


def class_weights_as_sample_weights(y, class_weight):
    """The sample weights `fit(x, y, class_weight=...)` gives arrays and a
    PyDataset's batches: each sample its class's weight (Keras'
    `data_adapter_utils.class_weight_to_sample_weights`, Keras 3.5 to 3.15:
    the class of a one-hot or probability row is its argmax)."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def class_weight_map_fn(class_weight):
    """The function `fit(dataset, class_weight=...)` maps over a
    `tf.data.Dataset` to weight its batches (Keras'
    `tf_dataset_adapter.make_class_weight_map_fn`, Keras 3.5 to 3.15)."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

    return make_class_weight_map_fn(class_weight)


def reduce_per_replica(values, strategy, reduction):
    """The replicas' values of a `strategy.run` as Keras' TensorFlow trainer
    reduces them (`keras.src.backend.tensorflow.trainer.reduce_per_replica`,
    Keras 3.5 to 3.15): "auto" as fit() reduces a step's logs, "concat" as
    predict() joins the replicas' predictions."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica as keras_reduce

    return keras_reduce(values, strategy, reduction=reduction)


# What TensorFlow says when a collective op meets one of another shape under
# the same keys (TF 2.16 and 2.21 word it alike).
_COLLECTIVE_SHAPE_MISMATCH = "Shape mismatch in the collective instance"
COLLECTIVE_KEYS_HINT = (
    "TensorFlow keys a MirroredStrategy's all-reduces by the order the strategy makes them, and every "
    "MirroredStrategy made in a process starts from the same keys: a step whose all-reduces differ from those "
    "of a step run under a strategy made earlier (another model, or the same model watched by the lab where "
    "it was not, or the other way round) collides with them. Restart the kernel (TensorFlow's collectives stay "
    "aborted after this error), then make one strategy and reuse it: `lab.strategy(\"mirrored\")` returns "
    "the same one each time.")


def collective_keys_reused(error):
    """Whether `error` is TensorFlow's collective shape mismatch, which a step
    meets when a MirroredStrategy made earlier in the process ran other
    all-reduces under the same keys (`COLLECTIVE_KEYS_HINT`).

    Args:
        error: Exception.

    Returns:
        bool.
    """
    return isinstance(error, tf.errors.OpError) and _COLLECTIVE_SHAPE_MISMATCH in str(error)


def failure_message(error):
    """What a run records of the error that ended a watched step: `Type:
    message`, and `COLLECTIVE_KEYS_HINT` after it where that is the cause."""
    message = f"{type(error).__name__}: {error}".strip()
    return message + "\n" + COLLECTIVE_KEYS_HINT if collective_keys_reused(error) else message


def warn_of_cause(error):
    """Warns `COLLECTIVE_KEYS_HINT` where it is the cause of `error`; never
    raises (with warnings made errors, the user's error is the one raised)."""
    if collective_keys_reused(error):
        with contextlib.suppress(Warning):
            warnings.warn(COLLECTIVE_KEYS_HINT, RuntimeWarning, stacklevel=3)
