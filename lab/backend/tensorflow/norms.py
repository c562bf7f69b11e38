"""Norms of the tensors a step reads, as the lab computes and finishes them.

Inside the step (eager, graph or XLA): `norms_of` (each tensor's norm, with
one overflow check for all), `encoded_norms_of` (half sums of squares for
the host to finish: no check, no branch) and the combinations of norms
(`global_norm`, `combined_norm`, `hypot`). On the host: `decode_norms`
finishes what `encoded_norms_of` left, bit for bit as the step would, and
`total_grad_norm` gives each step's norm over every variable. A finite
tensor whose sum of squares overflows float32 keeps a finite norm where the
step computes it (`scaled_norm`), and is inf with a message where the host
finishes it (`infinite_norms_message`).
"""

import numpy as np
import tensorflow as tf

from lab import schema
from lab.backend.tensorflow.compat import in_xla_trace, rarely, slow_xla_cpu_trace


def shown_names(names, most=4):
    """The first `most` of `names` joined by commas, with how many more."""
    names = list(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def scaled_norm(tensor):
    """The Euclidean norm of `tensor` in float32, finite whenever it fits in
    float32: computed as `m * sqrt(sum((x / m)^2))` with `m = max |x|`, where
    a plain `sqrt(sum(x * x))` overflows for elements near 1e19."""
    x = tf.reshape(tf.cast(tensor, tf.float32), [-1])
    m = tf.reduce_max(tf.abs(x)) if x.shape[0] != 0 else tf.constant(0.0)
    safe = tf.where(m > 0, m, 1.0)
    return tf.where(tf.math.is_finite(m), m * tf.sqrt(tf.reduce_sum(tf.square(x / safe))), m)


def norms_of(tensors):
    """The norms of several tensors (a 1-D float32 tensor), as `scaled_norm`
    gives them but cheaper: plain sums of squares, and only when one of them
    overflows, the scaled computation (one check for all, `compat.rarely`:
    one Switch in a graph, however many tensors)."""
    squares = 2.0 * tf.stack([half_sum_of_squares(t) for t in tensors])
    return rarely(lambda: tf.sqrt(squares), tf.reduce_all(tf.math.is_finite(squares)), _scaled_norms, tensors)


def encoded_norms_of(tensors):
    """The norms of several tensors left for the host to finish
    (`decode_norms`): each tensor's half sum of squares (`tf.nn.l2_loss`),
    stacked. One kernel per tensor and one stack, with no check and no
    branch in the step.

    Wherever `norms_of` takes its plain path (each sum doubles to a finite
    float32: the usual case), `decode_norms` gives its values bit for bit
    (the doubling is exact, and a float32 square root is correctly rounded
    on the device and on the host alike). Where a finite tensor's sum of
    squares overflows float32 (a norm over about 1.8e19), the norm comes out
    inf, as for a tensor with an infinite element: the host cannot tell the
    two apart, and the run says so (`infinite_norms_message`). `norms_of`'s
    overflow check would keep such a norm exact, but as an `If` node that
    reads every tensor it cost more than the norms themselves: on the
    50-variable MLP's step (3.4 ms) +250 us with gradients and +340 us with
    weights, 7-10% of the step (same model, bare and watched train
    functions taking turns, 2026-12-03).

    Each tensor has a kernel of its own, whose only input is that tensor.
    Keras hands the gradients to the optimizer through one `IdentityN` of
    all of them, which Grappler removes while each reader takes one output;
    a node that reads several (small gradients stacked and summed together,
    which saves kernels) keeps it, and then every variable's update waits
    for the whole backward pass: slower, not faster, on the 50-variable MLP
    (`benchmarks/README.md`, 2026-12-06)."""
    return tf.stack([half_sum_of_squares(t) for t in tensors])


# The fewest elements a tensor sums over columns (`half_sum_of_squares`):
# below it the columns' slices cost more than they save.
_COLUMN_SUM_ELEMENTS = 4096


def half_sum_of_squares(tensor):
    """`sum(x * x) / 2` of `tensor` in float32, as `tf.nn.l2_loss` gives it
    (one kernel, with no intermediate tensor), in the form the program being
    traced computes fastest.

    Where XLA compiles a whole tensor's sum for a CPU into a loop it does
    not vectorize (`lab.compat.slow_xla_cpu_trace`), a large tensor is
    summed over 4 columns first. The sum is the same up to float rounding
    (another order of additions), as XLA's own is to TensorFlow's kernel."""
    tensor = tf.cast(tensor, tf.float32)
    elements = tensor.shape.num_elements()
    if elements is None or elements < _COLUMN_SUM_ELEMENTS or not slow_xla_cpu_trace():
        return tf.nn.l2_loss(tensor)
    flat = tf.reshape(tensor, [-1])
    head = elements - elements % 4
    columns = tf.reshape(flat[:head], [-1, 4])
    # Halved before the sum, as TensorFlow's l2_loss kernel does.
    half = tf.reduce_sum(tf.reduce_sum(columns * columns * 0.5, axis=0))
    if head < elements:
        rest = flat[head:]
        half += tf.reduce_sum(rest * rest * 0.5)
    return half


def summed_rows(gradient):
    """A gradient as the lab reads it for norms and finiteness: a tensor as
    it is; a sparse one (`tf.IndexedSlices`: an Embedding's, a `tf.gather`'s)
    as its rows summed by index, which are the rows of the dense gradient
    that can be non-zero. Their norm and finiteness are the dense
    gradient's, at a cost that follows the batch, not the table: made dense,
    an Embedding's gradient is a copy of the whole table at every step,
    where plain SGD applies it as it is. Each row sums its slices in the
    order the dense conversion adds them (an `unsorted_segment_sum` either
    way). Under XLA, whose programs need static shapes (`tf.unique`'s is
    not), it stays as it is and goes dense there, as the step's own does."""
    if not isinstance(gradient, tf.IndexedSlices) or in_xla_trace():
        return gradient
    unique, position = tf.unique(gradient.indices)
    return tf.math.unsorted_segment_sum(gradient.values, position, tf.size(unique))


def newly_infinite(infinite, told):
    """Of `infinite` (norm column -> where it is first inf), the columns
    not in `told`, ordered by where; adds them to `told` (each column is
    told of once)."""
    names = sorted((column for column in infinite if column not in told), key=infinite.get)
    told.update(names)
    return names


def infinite_norms_message(columns, step, also=""):
    """What the run says when norm `columns` (a list, first inf at `step`)
    are inf in rows whose norms the host finished; `also`: a sentence
    for the caller's case."""
    return (f"{shown_names(columns)} {'is' if len(columns) == 1 else 'are'} inf from step {step}: the tensor has an "
            "infinite element, or its sum of squares overflows float32 (a norm over about 1.8e19), "
            f"which the lab cannot tell apart.{also} `lab.breakpoints.nonfinite()` stops at infinite "
            "gradients.")


def decode_norms(encoded):
    """Norms from `encoded_norms_of`'s values: a numpy array (on the host)
    or a tensor (inside a step, where values must be combined). NaN stays
    NaN; an overflow branch's -0.0 is the norm 0."""
    if isinstance(encoded, np.ndarray):
        encoded = encoded.astype(np.float32, copy=False)
        return np.where(encoded < 0, -encoded, np.sqrt(np.float32(2.0) * np.abs(encoded))).astype(np.float32)
    return tf.where(encoded < 0, -encoded, tf.sqrt(2.0 * tf.abs(encoded)))


# The most elements `_scaled_norms` concatenates at once (64 MiB of float32).
_CHUNK_ELEMENTS = 2**24


def _scaled_norms(tensors):
    """`scaled_norm` of each tensor, in a dozen ops per chunk of tensors.

    This is the rare branch of `norms_of`. Under XLA it is compiled with
    the step, so it is kept small: a per-tensor computation here cost 60 us
    a step for 50 variables on a CPU while a graph ran it as dead nodes.
    Its concatenation and segment ids are as large as the tensors together,
    so they go in chunks of at most `_CHUNK_ELEMENTS` (a tensor larger than
    that is a chunk of its own): a large model's gradients, weights and
    updates are never copied at once (and under XLA, whose memory plan for
    the step may count the branch's buffers whether or not it runs, that
    plan grows by a chunk, not by the model)."""
    static = [t.shape.num_elements() for t in tensors]
    if None in static or sum(static) <= _CHUNK_ELEMENTS:
        return _scaled_norms_together(tensors)
    chunks, size = [[]], 0
    for tensor, elements in zip(tensors, static):
        if chunks[-1] and size + elements > _CHUNK_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(tensor)
        size += elements
    return tf.concat([_scaled_norms_together(chunk) for chunk in chunks], axis=0)


def _scaled_norms_together(tensors):
    count = len(tensors)
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
    segments = _segment_ids([t.shape.num_elements() for t in tensors], tensors)
    # An empty segment's max is the lowest float: its norm is 0. A NaN
    # element makes the sum NaN whether or not the max keeps it.
    largest = tf.maximum(tf.math.unsorted_segment_max(tf.abs(flat), segments, count), 0.0)
    safe = tf.where(largest > 0, largest, 1.0)
    scaled = tf.math.unsorted_segment_sum(tf.square(flat / tf.gather(safe, segments)), segments, count)
    return tf.where(tf.math.is_finite(largest), largest * tf.sqrt(scaled), largest)


def _segment_ids(static, tensors):
    """For the concatenation of `tensors` (of `static` sizes, None where
    unknown), the index of the tensor each element comes from (int32).

    A count of tensor starts up to each element: shapes stay static under
    XLA, where `tf.repeat`'s bounded output fails to compile for some sizes
    (a Dense 256x256 among 18 tensors). An empty tensor starts where the
    next one does, so its index is skipped; one at the end starts past
    the last element, in a slot that is dropped."""
    if None not in static:
        total = sum(static)
        starts = tf.constant(np.cumsum([0] + static[:-1]).reshape(-1, 1), tf.int32)
    else:
        sizes = tf.stack([tf.size(t, out_type=tf.int32) for t in tensors])
        total = tf.reduce_sum(sizes)
        starts = tf.reshape(tf.cumsum(sizes, exclusive=True), [-1, 1])
    marks = tf.scatter_nd(starts, tf.ones([len(static)], tf.int32), tf.reshape(total + 1, [1]))
    return tf.cumsum(marks[:-1]) - 1


def global_norm(norms):
    """`combined_norm` by the cheap path: the root of the plain sum of
    squares, and only when that overflows, the scaled computation. `norms`
    is a list of scalars or a 1-D tensor of them."""
    norms = _as_vector(norms)
    present = tf.logical_not(tf.math.is_nan(norms))
    square = tf.reduce_sum(tf.square(tf.where(present, norms, 0.0)))
    plain = tf.where(tf.reduce_any(present), tf.sqrt(square), np.float32(np.nan))
    return rarely(lambda: plain, tf.math.is_finite(square), lambda values: combined_norm(values[0]), [norms])


def combined_norm(norms):
    """The norm of the concatenation of parts whose norms are `norms`
    (NaN entries are parts with no value), scaled as `scaled_norm`."""
    norms = _as_vector(norms)
    present = tf.logical_not(tf.math.is_nan(norms))
    values = tf.where(present, norms, 0.0)
    m = tf.reduce_max(values)
    safe = tf.where(m > 0, m, 1.0)
    total = tf.where(tf.math.is_finite(m), m * tf.sqrt(tf.reduce_sum(tf.square(values / safe))), m)
    return tf.where(tf.reduce_any(present), total, np.float32(np.nan))


def _as_vector(norms):
    if isinstance(norms, (list, tuple)):
        return tf.stack([tf.cast(n, tf.float32) for n in norms])
    return tf.reshape(tf.cast(norms, tf.float32), [-1])


def hypot(old, new):
    """Combines norms elementwise, `sqrt(old^2 + new^2)` without overflow
    (NaN in `old`: none yet). Works on scalars and on vectors of norms."""
    old = tf.cast(old, tf.float32)
    new = tf.cast(new, tf.float32)
    none = tf.math.is_nan(old)
    old0 = tf.where(none, 0.0, old)
    m = tf.maximum(old0, new)
    safe = tf.where(m > 0, m, 1.0)
    both = m * tf.sqrt(tf.square(old0 / safe) + tf.square(new / safe))
    both = tf.where(tf.math.is_finite(m), both, m)
    return tf.where(none, new, both)


def total_grad_norm(columns, updates, stepped=()):
    """The norm of all the gradients of each step, from its per-variable
    `grad_norm/<path>` columns (arrays): the root of their sum of squares,
    on the host in float64 (no overflow), NaN where no update ran or no
    variable had a gradient. A NaN in a column the step gives a value
    (`stepped`) is a NaN gradient, and makes the total NaN; in another, it
    is no gradient. None when there are no such columns."""
    names = [name for name in columns if name.startswith("grad_norm/") and schema.is_variable_column(name)]
    if not names:
        return None
    norms = np.asarray([columns[name] for name in names], np.float64)
    given = np.array([[name in stepped] for name in names])
    present = ~np.isnan(norms) | given
    total = np.sqrt(np.sum(np.where(present, norms, 0.0) ** 2, axis=0))
    return np.where((np.asarray(updates) > 0) & present.any(axis=0), total, np.nan).astype(np.float32)
