"""LoopProbe: the Probe's optimizer hooks for a hand-written training loop.

There is no `train_step` to bracket, so every value an optimizer hook
measures goes into a device-side ring of rows, one row per step, whatever
graph the user's step runs in (eager, `tf.function`, XLA). The graph writes
the running row, whose start each call of the function takes from the host
as an input (a call-time capture); `take()` closes a step by moving the
host's row number (no op), `read_rows()` reads the closed rows in one
block and `reset_rows()` resets them once the run has them. `row_columns` turns them into row columns on the
host. The ring belongs to the model's life, not to one watch block: a step
traced inside one block keeps writing it in later blocks.

The hook on `apply` also names the fix for what a hand-written step gets
wrong: no gradient at all (the loss computed outside the tape), `None`
gradients for some variables, and a `tf.function` that traces again and again.
"""

import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from lab.backend.tensorflow import compat
from lab.backend.tensorflow.compat import in_xla_trace
from lab.backend.tensorflow.norms import half_sum_of_squares, infinite_norms_message, newly_infinite, total_grad_norm
from lab.backend.tensorflow.probes import Probe, StepState, _replica_context, overwritten
from lab.variables import variable_keys

# Slots kept free for variables the model did not list when watching began
# (a subclassed model is often built by its first step).
_SPARE_SLOTS = 32
_SPARE_SLOTS_UNBUILT = 256
# The ring's size at most, in float32 slots: 64 MiB.
_RING_SLOTS = 2 ** 24
# Steps the device ring keeps between reads, at least (watch's default capacity).
_RING_STEPS = 1024
# Rows whose start is made once, as a tensor, for every call (past these, at each call).
_KEPT_OFFSETS = 4 * _RING_STEPS
# optimizer -> the loop probes that watch it (an optimizer may serve several models).
_WATCHED_OPTIMIZERS = weakref.WeakKeyDictionary()
# Slots of half sums of squares (`tf.nn.l2_loss`), which the host finishes into
# `grad_norm/`, `weight_norm/` and `update_ratio/` columns.
_GRAD_HALF = "_grad_half/"
_WEIGHT_HALF = "_weight_half/"
_UPDATE_HALF = "_update_half/"
# A gradient's slot before any apply added to it: -0.0 plus any square (+0.0
# included) is that square, so a slot still -0.0 had no gradient.
_NONE_ADDED = np.float32(-0.0)
# Traces of one tf.function after which the lab says why it keeps tracing.
RETRACE_WARNING = 4

ALL_NONE_MESSAGE = (
    "The optimizer {name!r} got no gradient for any of its {count} variables: the "
    "loss does not depend on them through the tape. Compute the loss inside the "
    "`with tf.GradientTape() as tape:` block (the forward pass `y_pred = model(x, "
    "training=True)` and `loss = loss_fn(y, y_pred)` both go inside it), then call "
    "`tape.gradient(loss, model.trainable_variables)` after the block."
)
SOME_NONE_MESSAGE = (
    "The optimizer {name!r} got `None` gradients for {missing} of {count} variables, "
    "so they never train: {paths}. If they should train, make sure the loss uses "
    "them inside the tape (a layer called outside the `GradientTape` block, or a "
    "branch the step never takes); if they are frozen on purpose, set "
    "`layer.trainable = False` or leave them out of `tape.gradient(...)` and "
    "`apply_gradients(...)`."
)


def _reaches(graph):
    """Whether a tensor of `graph` (None: an eager one) can be read here:
    eagerly from eager code, else from its own graph or one nested in it."""
    if graph is None:
        return tf.executing_eagerly()
    now = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    while now is not None and now is not graph:
        now = getattr(now, "outer_graph", None)
    return now is graph


def _concat(values):
    """Scalars and 1-D tensors as one 1-D tensor, in order (runs of scalars stacked)."""
    pieces, run = [], []
    for value in values:
        if value.shape.rank == 0:
            run.append(value)
            continue
        if run:
            pieces.append(tf.stack(run))
            run = []
        pieces.append(value)
    if run:
        pieces.append(tf.stack(run))
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)


class _LoopState(StepState):
    """The one step state of a watched loop: every value goes to a slot."""

    def nested(self):
        return True


class _ThreadState(threading.local):
    """Stands in for the Probe's per-thread step state: always present, one
    per thread (each replica of a strategy traces in its own thread)."""

    def __init__(self):
        super().__init__()
        self.state = _LoopState()
        # (graph or None eagerly, loss): what a LossScaleOptimizer's
        # `scale_loss` got last, for the next gate (`LoopProbe._gate`).
        self.scaled_loss = None


class _LoopSlots:
    """One model's ring of step rows, kept for the model's life (never on it) across watch blocks.

    The ring is one flat float32 variable of `rows` rows of `width` slots;
    `position` is the row the running step writes. It lives on the host
    only: each call of a traced step takes where that row starts as an input
    (`offset_in`), so closing a step costs no op on the device.
    A `tf.function` step traced inside one block keeps that block's hooks in
    its graph: it writes this same ring when a later block runs it, so a step
    may be watched again without tracing it again.
    """

    def __init__(self, names, spare, rows, make_variable):
        self.index = {name: position for position, (name, _) in enumerate(names)}
        self.resets = [reset for _, reset in names] + [np.nan] * spare
        self.width = len(self.resets)
        self.rows = max(2, min(rows, _RING_SLOTS // self.width))
        self.vector = make_variable("lab_loop_rows", self._reset_rows(self.rows))
        self.position = 0
        # Row -> where it starts, as the int32 tensor each call of a step takes
        # (the first _KEPT_OFFSETS rows), all made now: made at the call that
        # first needs it, between two steps that leave the caches cold, each
        # cost that step 40-80 us for the whole first lap of the ring (about
        # 5 us each here, 5 ms for the usual 1,025 rows).
        with tf.init_scope():
            self._starts = {row: tf.constant(row * self.width, tf.int32)
                            for row in range(min(self.rows, _KEPT_OFFSETS))}
        self._row_indices = {}
        self.active = make_variable("lab_loop_active", 0.0)
        self.hold = make_variable("lab_hold", 0.0)
        # Device breakpoints' hits told to the host by the step itself (see
        # LoopProbe._tell_hits), so the loop need not read the device at each
        # step: whether a hit was told since the last look, and whether every
        # gate traced for this model tells them (None: none traced yet).
        self.hit_was_told = False
        self.gates_tell = None

    def gate_traced(self, tells):
        """Notes a traced breakpoint gate; `tells`: whether it tells its hits to the host."""
        self.gates_tell = tells if self.gates_tell is None else (self.gates_tell and tells)

    def tell_hit(self, value):
        """Called by a step (through `tf.numpy_function`) when a breakpoint hits."""
        self.hit_was_told = True
        return np.float32(value)

    def take_told(self):
        """Whether a hit was told since the last call."""
        told, self.hit_was_told = self.hit_was_told, False
        return told

    def add(self, name, reset=np.nan):
        """Gives `name` a free slot, which holds `reset` in every row from now
        on; None when none is left."""
        if name not in self.index and len(self.index) < self.width:
            index = self.index[name] = len(self.index)
            self.resets[index] = reset
            if not np.isnan(reset):
                self._fill(index, reset)
        return self.index.get(name)

    def _fill(self, index, value):
        """Writes `value` into slot `index` of every row, now.

        A free slot holds NaN in every row. A gradient's slot, added while a
        step is traced (a variable the model did not list when watching
        began), adds its squares onto what its row holds: left NaN until the
        rows were read and reset, one lap of the ring later, it gave NaN
        norms for the ring's first 1,025 steps. Run eagerly, also from inside
        a trace (`init_scope`), on every copy of a mirrored ring.
        """
        with tf.init_scope():
            indices = tf.constant(np.arange(self.rows, dtype=np.int64) * self.width + index)
            values = tf.constant(np.full(self.rows, value, np.float32))
            copies = self.vector.values if isinstance(self.vector, tf.distribute.DistributedValues) else [self.vector]
            for copy in copies:
                tf.raw_ops.ResourceScatterUpdate(resource=copy.handle, indices=indices, updates=values)

    def _reset_rows(self, count):
        """`count` rows of reset values, flat (numpy)."""
        return np.tile(np.array(self.resets, np.float32), count)

    def reset(self):
        """Every row back to its reset values, row 0 running (a block's start)."""
        self.vector.assign(self._reset_rows(self.rows))
        self.position = 0
        self.hit_was_told = False

    def advance(self):
        """Closes the running row: the next one runs (host only, no op); returns the closed row."""
        closed = self.position
        self.position = (closed + 1) % self.rows
        return closed

    def offset_in(self, graph):
        """Where the running row starts, as an int32 tensor of `graph` (being traced).

        It is an input of the traced function, given at each call the row
        that runs then (`capture_call_time_value`); a function traced inside
        another takes it from the outer one's input. A branch of a `tf.cond`
        or a loop's body takes its function's.
        """
        top = graph
        while isinstance(top, ControlFlowFuncGraph):
            top = top.outer_graph
        if not isinstance(top, FuncGraph):
            raise RuntimeError(
                "lab.watch records steps that run eagerly or in a `tf.function`; this step "
                "runs in a TF1 graph (`tf.compat.v1`). Run it eagerly or in a `tf.function`.")
        # Outside any TF1 control-flow context (a TPU replicate's): an input of the whole function.
        with top.as_default(), tf.control_dependencies(None):
            offset = top.capture_call_time_value(self._running_offset, tf.TensorSpec([], tf.int32), key=self,
                                                 default_value=np.int32(0))
        compat.light_call_time_value(top, self, self._running_offset)
        return offset

    def _running_offset(self):
        offset = self._starts.get(self.position)
        if offset is None:  # a row past the kept ones
            with tf.init_scope():
                offset = tf.constant(self.position * self.width, tf.int32)
        return offset

    def row(self, position):
        """One row's values (numpy), read alone (waits for the device)."""
        indices = self._row_indices.get(position)
        if indices is None:
            # Made from host memory, not by an op: `tf.range` is an eager op,
            # 0.1-0.7 ms after a run of steps, once per row until the ring laps.
            with tf.init_scope():
                indices = self._row_indices[position] = tf.constant(
                    np.arange(position * self.width, (position + 1) * self.width, dtype=np.int32))
        return tf.raw_ops.ResourceGather(resource=self.vector.handle, indices=indices, dtype=tf.float32).numpy()

    def read_rows(self, positions):
        """The closed rows at `positions` (rows x width, numpy), in one read.

        They stay as they are until `reset_rows`, once the run has them: a
        Ctrl-C landing where the host waits for this read (or a warning made
        an error before the rows reach the run) leaves them to be read again.
        The running row is neither read nor reset: a step writing it while
        another thread reads the run loses nothing.
        """
        values = tf.raw_ops.ResourceGather(resource=self.vector.handle, indices=self._flat(positions),
                                           dtype=tf.float32)
        return values.numpy().reshape(len(positions), self.width)

    def reset_rows(self, positions):
        """Puts the rows at `positions` back to their reset values (one eager op)."""
        tf.raw_ops.ResourceScatterUpdate(resource=self.vector.handle, indices=self._flat(positions),
                                         updates=tf.constant(self._reset_rows(len(positions))))

    def _flat(self, positions):
        """The ring's indices of every slot of the rows at `positions` (an int64 tensor)."""
        positions = np.asarray(positions, np.int64)
        return tf.constant((positions[:, None] * self.width + np.arange(self.width)).reshape(-1), tf.int64)


_SLOTS = weakref.WeakKeyDictionary()  # model -> _LoopSlots


class LoopProbe(Probe):
    """A Probe on the optimizers of a hand-written loop, its values in slots.

    Args:
        model: keras.Model, whose `trainable_variables` name the columns.
        optimizers: dict, name -> keras optimizer the loop uses.
        gradients: bool, record per-variable norms of the applied gradients.
        weights: bool, record weight norms and update/weight ratios.
        breakpoints: sequence of device-side breakpoints (`nonfinite()`).
        capacity: int, steps kept on the device between reads.
    """

    # The loop's values go into slots by name, plain (see `Probe.FINISHES_ON_HOST`).
    FINISHES_ON_HOST = False

    def __init__(self, model, optimizers, gradients=True, weights=False, breakpoints=(), capacity=1024):
        super().__init__(model, gradients=gradients, weights=weights, breakpoints=breakpoints,
                         capacity=capacity)
        self.optimizers = dict(optimizers)
        self._local = _ThreadState()
        self._writes = threading.local()
        self._slots = None
        self._frozen = None
        self._seen = set()  # the slots this block writes: its columns (`freeze`)
        self._kind_slots = {}  # (optimizer, kind) -> the slots its updates write (`freeze`)
        self._traces = {}
        self._warned = set()
        self._infinite_told = set()  # norm columns whose inf was told of
        self.warnings = []  # (message, step) the run turns into events

    # ---- installing --------------------------------------------------------

    def install(self):
        """Patches each optimizer's `apply` and update step (instance attributes)."""
        if self.installed:
            return
        self._hooks.claim("probe", self, (
            f"The model {self.model.name!r} is already watched (another `lab.watch` block "
            "or a Recorder is attached). Leave that block first."))
        for name, optimizer in self.optimizers.items():
            for other in _WATCHED_OPTIMIZERS.get(optimizer, ()):
                if other is not self and other.installed:
                    self._hooks.release(self)
                    raise RuntimeError(
                        f"The optimizer {name!r} is already watched (another `lab.watch` block "
                        "or a Recorder is attached). Leave that block first."
                    )
        self._variable_keys = variable_keys(self.model.trainable_variables)
        self._optimizer_names = list(self.optimizers)
        self._allocate_slots()
        for name, optimizer in self.optimizers.items():
            _WATCHED_OPTIMIZERS.setdefault(optimizer, weakref.WeakSet()).add(self)

            def checked_apply(apply, name=name, optimizer=optimizer):
                if self.breakpoints:
                    apply = self._wrap_apply(optimizer, apply, name)
                return self._wrap_checks(name, optimizer, apply)

            self._patch(optimizer, "apply", checked_apply)
            if self.breakpoints and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                self._patch(optimizer, "scale_loss", self._wrap_scale_loss)
            for part_name, inner in compat.updating_optimizers(name, optimizer):
                self._patch_update(part_name, inner)
        self._slots.active.assign(1.0)

    def uninstall(self):
        """Restores every patched method; graphs traced meanwhile stop gating."""
        super().uninstall()
        if self._slots is not None:
            self._slots.active.assign(0.0)
        self.release()

    def _allocate_slots(self):
        # Each learning rate under the name of the optimizer whose update step
        # runs (each of a MultiOptimizer's), the rest under the watched one's.
        self._rate_names = {part: name for name, optimizer in self.optimizers.items()
                            for part, _ in compat.updating_optimizers(name, optimizer)}
        names = [(f"_lr/{name}", np.nan) for name in self._rate_names]
        names += [(f"_updates/{name}", 0.0) for name in self.optimizers]
        names += [(f"_applied/{name}", 0.0) for name in self.optimizers]
        names += [("_updates", 0.0), ("_overflow", 0.0)]
        keys = list(self._variable_keys.values())
        # Every kind, whatever this block records: a later block may ask for them.
        # A gradient's half sum of squares adds up over the step's applies
        # from -0.0 (none yet); a weight's and an update's are the last apply's.
        names += [(f"{_GRAD_HALF}{key}", _NONE_ADDED) for key in keys]
        names += [(f"{kind}{key}", np.nan) for kind in (_WEIGHT_HALF, _UPDATE_HALF) for key in keys]
        names += [("_hit", 0.0), ("_held", 0.0), ("_gated", 0.0)]
        slots = _SLOTS.get(self.model)
        if slots is not None and slots.active.numpy() > 0:
            raise RuntimeError(
                f"The model {self.model.name!r} is already watched by an open `lab.watch` "
                "block; watch it once, with all its optimizers: `lab.watch(model, opt_a, opt_b)`.")
        if slots is None:
            spare = _SPARE_SLOTS if self.model.built else _SPARE_SLOTS_UNBUILT
            # A row per step kept between reads, and the running one; never
            # fewer than by default, since a later block may keep more.
            rows = max(self.capacity, _RING_STEPS) + 1
            slots = _SLOTS[self.model] = _LoopSlots(names, spare, rows, self._make_ring_variable)
        for name, reset in names:
            slots.add(name, reset)
        slots.reset()
        self._seen = {name for name, _ in names}
        self._slots = slots
        self._hold = slots.hold
        self._hold.assign(0.0)  # a block starts with nothing held

    def _make_ring_variable(self, name, initial):
        """A variable of the ring: one copy, also for a block entered inside a
        strategy's scope (keras-io's distributed guide keeps all its code
        there), on the first replica's device. Every replica's step writes the
        first replica's values once (`_scatter`) and the host reads them:
        a MirroredVariable's copies take no such write (it failed the step).
        A TPU's ring is made as the strategy makes its variables."""
        if not tf.distribute.has_strategy():
            return self._make_variable(name, initial)
        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, tf.distribute.TPUStrategy):
            return self._make_variable(name, initial)
        return compat.single_copy_variable(name, initial, strategy.extended.worker_devices[0])

    # ---- values into slots -------------------------------------------------

    def _index(self, name, reset):
        index = self._slots.index.get(name)
        if index is None and self._frozen is None:
            index = self._slots.add(name, reset)
        if index is not None:
            self._seen.add(name)
            return index
        self.warn_once(("slot", name), (
            f"The lab cannot record {name!r}: it appeared after recording started or "
            "there are too many variables. Build the model (call it on one batch) "
            "before `lab.watch` begins."), RuntimeWarning)
        return None

    def _emit(self, state, name, value, reset=np.nan, accumulate=False, combine=None):
        index = self._index(name, reset)
        if index is None:
            return
        value = tf.cast(value, tf.float32)
        if combine is not None:
            value, accumulate = combine(self._slots.vector.sparse_read(self._row_offset() + index), value), False
        self._put(([index], value, accumulate))

    def _emit_vector(self, state, names, vector, reset=np.nan, combine=None):
        indices = [self._index(name, reset) for name in names]
        kept = [i for i, index in enumerate(indices) if index is not None]
        if not kept:
            return
        vector = tf.cast(vector, tf.float32)
        if len(kept) < len(names):
            vector = tf.gather(vector, kept)
        where = [indices[i] for i in kept]
        if combine is not None:
            vector = combine(self._slots.vector.sparse_read(tf.constant(where, tf.int32) + self._row_offset()), vector)
        self._put((where, vector, False))

    def _emit_scalars(self, names, values, reset, accumulate):
        """Puts scalar tensors `values` under `names`, each its own item: the
        scalars of one mode go into the row in one stack, with the others'."""
        for name, value in zip(names, values):
            index = self._index(name, reset)
            if index is not None:
                self._put(([index], value, accumulate))

    def _put(self, item):
        """One write to the slots: ([indices], scalar or vector, mode), mode
        False (assign) or True (add); batched inside an update, so each mode
        costs one scatter. A value that combines with what the row holds
        (`combine(old, new)`) is combined before it is put."""
        batch = getattr(self._writes, "batch", None)
        if batch is not None:
            batch.append(item)
        else:
            self._scatter([item])

    def _row_offset(self):
        """Where the running row starts in the ring: a Python int in an eager
        step, else the function's input that the host gives at each call."""
        slots = self._slots
        if tf.executing_eagerly():
            return slots.position * slots.width
        # One input per function: offset_in gives the same one again (keyed by the ring).
        return slots.offset_in(tf.compat.v1.get_default_graph())

    def _scatter(self, items):
        """Writes `items` to the running row. Under several replicas, one write
        for all, of the first replica's values: after the all-reduce every
        replica applies the same gradients, and a write from each would count
        one update as several."""
        ctx = _replica_context()
        if ctx is None:
            self._write(items)
            return

        def write_first(distribution, *values):
            first = [distribution.experimental_local_results(value)[0] for value in values]
            self._write([(indices, value, mode) for (indices, _, mode), value in zip(items, first)])

        ctx.merge_call(write_first, args=tuple(value for _, value, _ in items))

    def _write(self, items):
        modes = []
        for _, _, mode in items:
            if not any(mode is m for m in modes):
                modes.append(mode)
        offset = self._row_offset()
        for mode in modes:
            chosen = [(indices, value) for indices, value, m in items if m is mode]
            where = [i for positions, _ in chosen for i in positions]
            if isinstance(offset, int):
                indices = tf.constant([[offset + i] for i in where], tf.int32)
            else:
                indices = tf.constant([[i] for i in where], tf.int32) + offset
            values = _concat([value for _, value in chosen])
            if mode:
                self._slots.vector.scatter_nd_add(indices, values)
            else:
                self._slots.vector.scatter_nd_update(indices, values)

    def _emit_update(self, state, name, variables, grads, learning_rate, before):
        """Puts one apply's values: its learning rate, its update counts, and
        the half sums of squares (`tf.nn.l2_loss`) of its gradients, weights
        and updates, which the host finishes into norms (`row_columns`).

        The step keeps two scatters (one that adds, one that assigns) and the
        `l2_loss` kernels, with no check and no branch: a gradient's halves
        add up over the applies of a step (several applies in a row cover
        them all, exactly as the norm of their concatenation). The norms'
        overflow check and the combine of applies (two conds, a square root
        and a dozen kernels) took the watched MLP step from about 80 to 200 us
        over the unwatched one. The one value this cannot give exactly is a
        norm whose sum of squares overflows float32 (over about 1.8e19): it
        is recorded as inf, and the run says so (`row_columns`).
        """
        self.traced_in_xla = self.traced_in_xla or in_xla_trace()
        rate_name, name = name, self._rate_names.get(name, name)
        if name not in state.optimizers:
            state.optimizers.append(name)
        self._writes.batch = []
        try:
            self._emit(state, f"_lr/{rate_name}", learning_rate)
            one = tf.constant(1.0)
            self._emit_scalars(["_updates", f"_updates/{name}"], [one, one], reset=0.0, accumulate=True)
            self._emit_halves(name, variables, grads, before)
            items = self._writes.batch
        finally:
            self._writes.batch = None
        self._scatter(items)

    def _emit_halves(self, name, variables, grads, before):
        if not (self.gradients or self.weights):
            return
        keys = self._keys(variables)
        present = [i for i in range(min(len(grads), len(variables))) if grads[i] is not None] if self.gradients else []
        weighed = self.weights and bool(variables)
        tensors = self._update_tensors(present, grads, variables, before)
        halves = [half_sum_of_squares(t) for t in tensors]
        self._emit_scalars([f"{_GRAD_HALF}{keys[i]}" for i in present], halves[:len(present)],
                           reset=_NONE_ADDED, accumulate=True)
        if weighed:
            names = [f"{_WEIGHT_HALF}{key}" for key in keys]
            if before is not None:
                names += [f"{_UPDATE_HALF}{key}" for key in keys]
            self._emit_scalars(names, halves[len(present):], reset=np.nan, accumulate=False)

    def _tell_hits(self, value):
        """Has the step tell the host when a device breakpoint hits (`value` > 0).

        The host then reads the device only on a hit: without this, `run.step`
        read each step's row to know whether to raise, a wait for the device
        and an eager op at every step (a third of what `nonfinite()` cost a
        hand-written loop, `benchmarks/README.md`). A `tf.cond` runs the host
        call only on a hit. Where a host call cannot run (inside XLA, or in a
        replica of a distribution strategy), the gate says so and the run
        keeps reading each step.
        """
        slots = self._slots
        tells = not in_xla_trace() and _replica_context() is None
        if tells:
            def tell():
                return tf.numpy_function(slots.tell_hit, [value], tf.float32, stateful=True, name="lab_tell_hit")

            tf.cond(value > 0, tell, lambda: value)  # eagerly: one read, as the run's own would be
        slots.gate_traced(tells)

    def tells_hits(self):
        """Whether every breakpoint gate traced for this model tells its hits to the host."""
        return bool(self._slots.gates_tell)

    def hit_told(self):
        """Whether a step told a hit since the last call."""
        return self._slots.take_told()

    def first_ungated(self, rows):
        """The first of `rows` (steps x slots, numpy, as `read_rows`) whose
        updates ran no breakpoint gate, as an index into `rows`; None if none."""
        index = self._slots.index
        ungated = np.flatnonzero((rows[:, index["_updates"]] > 0) & ~(rows[:, index["_gated"]] > 0))
        return int(ungated[0]) if ungated.size else None

    def first_unrecorded(self, rows):
        """Per setting of this block that a graph traced in an earlier block
        may lack (`"gradients"`, `"weights"`): the first of `rows` (steps x
        slots, as `read_rows`) in which an optimizer updated and wrote none
        of that setting's slots, as an index into `rows`. Settings with none
        are left out."""
        found = {}
        for (name, kind), where in self._kind_slots.items():
            values = rows[:, where]
            unwritten = (np.signbit(values) & (values == 0)) if kind == _GRAD_HALF else np.isnan(values)
            updated = rows[:, self._slots.index[f"_updates/{name}"]] > 0
            hits = np.flatnonzero(updated & unwritten.all(axis=1))
            setting = "gradients" if kind == _GRAD_HALF else "weights"
            if hits.size and (setting not in found or hits[0] < found[setting]):
                found[setting] = int(hits[0])
        return found

    def _gate(self, state, grads, keys=()):
        # A watched loop raises at the hit's step, naming what it read there:
        # no per-gradient flags (`keys` unused).
        scaled, self._local.scaled_loss = self._local.scaled_loss, None
        state.loss = scaled[1] if scaled is not None and _reaches(scaled[0]) else None
        try:
            skip = super()._gate(state, grads)
        finally:
            state.loss = None
        self._emit(state, "_gated", 1.0, reset=0.0, accumulate=True)
        return skip

    def _wrap_scale_loss(self, original):
        """A LossScaleOptimizer's gate checks no gradient (an overflow of the
        scaled ones is its own business: it skips the update and lowers its
        scale) but the loss, which a loop hands the lab only at `run.step`,
        after the update: the loss the loop scales is kept for the gate of
        the next apply in the same graph (as fit()'s gate checks the step's)."""
        local = self._local

        def scale_loss(loss):
            local.scaled_loss = (None if tf.executing_eagerly() else tf.compat.v1.get_default_graph(), loss)
            return original(loss)

        return scale_loss

    def _gate_open(self):
        # A graph traced while watching keeps this gate; it acts only inside a
        # block: outside, the step updates as bare and no hit is held.
        return self._slots.active.read_value() > 0

    # ---- checks on what the loop hands the optimizer ---------------------

    def _wrap_checks(self, name, optimizer, apply):
        probe = self

        def apply_checked(grads, trainable_variables=None):
            grads = list(grads)
            variables = list(trainable_variables) if trainable_variables is not None else None
            if variables is None and optimizer.built:
                variables = compat.optimizer_variables_for(optimizer)
            probe._check_gradients(name, grads, variables)
            if not tf.executing_eagerly():
                probe._note_trace()
            return apply(grads, trainable_variables if variables is None else variables)

        return apply_checked

    def _check_gradients(self, name, grads, variables):
        missing = [i for i, g in enumerate(grads) if g is None]
        if not grads or not missing:
            return
        if len(missing) == len(grads):
            raise ValueError(ALL_NONE_MESSAGE.format(name=name, count=len(grads)))
        paths = ", ".join(self._key(variables[i]) if variables else f"#{i}" for i in missing)
        self.warn_once(("none", name, paths), SOME_NONE_MESSAGE.format(
            name=name, missing=len(missing), count=len(grads), paths=paths), UserWarning)

    def _note_trace(self):
        found = compat.tracing_tf_function(_describe)
        if found is None:
            return
        function, arguments = found
        record = self._traces.setdefault(id(function), {"function": function, "traces": {}})
        trace = function.experimental_get_tracing_count()
        if trace in record["traces"]:
            return  # a second optimizer in the same trace
        record["traces"][trace] = arguments
        if len(record["traces"]) >= RETRACE_WARNING:
            self.warn_once(("retrace", id(function)), _retrace_message(function, list(record["traces"].values()),
                                                                        self.steps_seen + 1), RuntimeWarning)

    steps_seen = 0  # the run keeps it current, for messages

    def warn_once(self, key, message, category, step=None):
        """Warns once per `key`; the run turns the warning into an event (at
        `step`, default: the step the loop is at)."""
        if key in self._warned:
            return
        self._warned.add(key)
        self.warnings.append((message, self.steps_seen if step is None else step))
        warnings.warn(message, category, stacklevel=4)

    # ---- the row -------------------------------------------------------------

    def updates_waiting(self):
        """Updates made since the last `take()`, by every optimizer (waits for the device)."""
        return float(self._slots.row(self._slots.position)[self._slots.index["_updates"]])

    def end_block(self):
        """Forgets the user's functions seen while the block was open (kept only while watching)."""
        self._traces.clear()

    def freeze(self):
        """Fixes which slots become columns (names appearing later are not recorded).

        Only this block's: the ring keeps the slots of every variable an
        earlier block saw (a variable no model holds, a model's part another
        optimizer trained), which this run would show as columns of NaN. A
        step traced in an earlier block writes without passing through this
        one's `_index`: the variables of the optimizers watched are this
        block's too.
        """
        variables = list(self.model.trainable_variables)
        for optimizer in self.optimizers.values():
            variables += compat.optimizer_variables_for(optimizer)
        keys = self._keys(variables)
        # Not those Keras overwrites with what it is handed as their gradient (float8's scales).
        for variable, key in zip(variables, keys):
            names = {f"{kind}{key}" for kind in (_GRAD_HALF, _WEIGHT_HALF, _UPDATE_HALF)}
            if overwritten(variable):
                self._seen -= names
            else:
                self._seen |= names
        several = len(self._rate_names) > 1
        # Per optimizer and kind asked for: the slots an update by a graph traced with that kind writes.
        self._kind_slots = {}
        for name, optimizer in self.optimizers.items():
            optimizer_keys = self._keys(compat.optimizer_variables_for(optimizer))
            for kind, asked in ((_GRAD_HALF, self.gradients), (_WEIGHT_HALF, self.weights)):
                where = [self._slots.index[f"{kind}{key}"] for key in optimizer_keys
                         if f"{kind}{key}" in self._slots.index]
                if asked and where:
                    self._kind_slots[name, kind] = where
        self._frozen = {}
        for name, index in self._slots.index.items():
            if name in self._seen and self._records(name):
                if name.startswith("_lr/"):
                    name = f"learning_rate/{name[4:]}" if several else "learning_rate"
                self._frozen[name] = index

    def _records(self, name):
        kind = name.split("/", 1)[0] + "/"
        if kind == "_lr/":
            return name[4:] in self._rate_names
        if kind in ("_hit/", "_held/", "_updates/"):
            return kind != "_updates/" or "/" in name
        return ((kind == _GRAD_HALF and self.gradients)
                or (kind in (_WEIGHT_HALF, _UPDATE_HALF) and self.weights))

    def take(self):
        """Closes this step's row (no op: the next call of the step writes the next row); returns where it is."""
        return self._slots.advance()

    def read_rows(self, taken):
        """The rows `take()` closed (steps x slots, numpy), read in one block; `reset_rows` once kept."""
        return self._slots.read_rows(taken)

    def reset_rows(self, taken):
        """Resets the rows `take()` closed, once the run has them."""
        self._slots.reset_rows(taken)

    @property
    def rows_kept(self):
        """Closed rows the device holds at most between reads."""
        return min(self.capacity, self._slots.rows - 1)

    def hit(self, taken):
        """The number of the device breakpoint that hit at one step, or 0; waits for it."""
        return int(self._slots.row(taken)[self._slots.index["_hit"]])

    def waiting_updates(self, name):
        """Updates by optimizer `name` since the last `take()` (waits for the device)."""
        return self._slots.row(self._slots.position)[self._slots.index[f"_updates/{name}"]]

    def _finished(self, column, halves, first_step, infinite):
        """Norms from a column's halves; notes in `infinite` (column -> first
        step) where one is inf."""
        norms = _norms(halves)
        where = np.flatnonzero(np.isinf(norms))
        if where.size:
            infinite[column] = first_step + int(where[0])
        return norms

    def _warn_infinite(self, infinite):
        """One warning for the columns that are inf for the first time."""
        names = newly_infinite(infinite, self._infinite_told)
        if names:
            step = infinite[names[0]]
            self.warn_once(("inf", tuple(names)), infinite_norms_message(names, step), RuntimeWarning, step=step)

    def row_columns(self, taken, first_step=0):
        """Row columns from stacked slot values (steps x slots, numpy), the
        rows' steps counted from `first_step`.

        The half sums of squares become norms as the step would have
        computed them (`sqrt(2 * half)` in float32, bit for bit), and update
        ratios `update norm / weight norm` (0 where the weight norm is 0, as
        `tf.math.divide_no_nan`). An infinite norm is reported once per
        column: it may be a finite norm whose sum of squares overflowed.
        """
        index = self._slots.index
        columns, infinite = {}, {}
        for name, i in self._frozen.items():
            kind, _, key = name.partition("/")
            kind += "/"
            if kind == _GRAD_HALF:
                columns[f"grad_norm/{key}"] = self._finished(f"grad_norm/{key}", taken[:, i], first_step, infinite)
            elif kind == _WEIGHT_HALF:
                columns[f"weight_norm/{key}"] = self._finished(f"weight_norm/{key}", taken[:, i], first_step, infinite)
            elif kind == _UPDATE_HALF:  # after its weight's column (slot order)
                update = self._finished(f"update_ratio/{key}", taken[:, i], first_step, infinite)
                weight = columns[f"weight_norm/{key}"]
                with np.errstate(divide="ignore", invalid="ignore"):
                    columns[f"update_ratio/{key}"] = np.where(weight == 0, np.float32(0), update / weight)
            else:
                columns[name] = taken[:, i]
        self._warn_infinite(infinite)
        updates = taken[:, index["_updates"]]
        columns["updated"] = (updates > 0).astype(np.float32)
        if self.gradients:
            total = total_grad_norm(columns, updates)
            columns["grad_norm"] = total if total is not None else np.full(len(taken), np.nan, np.float32)
        return columns


def _norms(halves):
    """Norms from half sums of squares (float32): NaN where none was put."""
    halves = halves.astype(np.float32, copy=False)
    norms = np.sqrt(np.float32(2) * halves)
    return np.where(np.signbit(halves) & (halves == 0), np.float32(np.nan), norms).astype(np.float32)


def _describe(value):
    if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, keras.Variable)):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (bool, int, float, str, np.generic)) or value is None:
        return ("python", value)
    return ("object", type(value).__name__)


def _retrace_message(function, traces, calls):
    name = getattr(function, "__name__", None) or getattr(function, "name", "the step")
    head = (f"The @tf.function `{name}` was traced {len(traces)} times in {calls} calls: "
            "it builds a new graph for every new Python value and every new input shape.")
    for kind, advice in (
        ("python", ("is a Python value that changed between traces ({values}): pass it as a "
                    "tensor (`tf.constant(...)`) or leave it out of the call.")),
        ("tensor", ("changed shape between traces ({values}): give the batches one shape "
                    "(`dataset.batch(n, drop_remainder=True)`) or trace for any batch size "
                    "with `@tf.function(reduce_retracing=True)`.")),
    ):
        for argument in traces[0]:
            seen = [t.get(argument) for t in traces]
            if seen[0] and seen[0][0] == kind and len(set(seen)) > 1:
                values = ", ".join(repr(s[1]) for s in seen[:5] if s)
                return f"{head} Its argument `{argument}` " + advice.format(values=values)
    return head + " Pass tensors of one shape and dtype, and no changing Python values."
