"""A per-step ring buffer that lives on the device, written inside the step.

Each training step writes one float32 row; the host reads rows in blocks.
This is what lets the lab keep every batch's own values when Keras runs
several steps per execution and reports only the last one.
"""

import numpy as np
import tensorflow as tf


class StepBuffer:
    """A ring of `capacity` rows of `width` float32 values plus a write count.

    Args:
        width: int, values per row.
        capacity: int, rows kept on the device before the oldest is overwritten.
        strategy: tf.distribute.Strategy or None; the variables are created
            under its scope so replica 0's write is the one kept.
    """

    def __init__(self, width, capacity=1024, strategy=None):
        self.width = int(width)
        self.capacity = int(capacity)
        self.read_count = 0
        with tf.init_scope():
            scope = strategy.scope() if strategy is not None else _null_scope()
            with scope:
                self.values = tf.Variable(
                    tf.fill([self.capacity, self.width], np.float32(np.nan)),
                    trainable=False,
                    name="lab_step_values",
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
                self.count = tf.Variable(
                    tf.constant(0, tf.int64),
                    trainable=False,
                    name="lab_step_count",
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
        self._distributed = strategy is not None and strategy.num_replicas_in_sync > 1

    def write(self, row):
        """Appends one row (a float32 tensor of shape [width]); callable in a tf.function."""
        row = tf.reshape(tf.cast(row, tf.float32), [1, self.width])
        index = tf.reshape(tf.math.floormod(self.count, self.capacity), [1, 1])
        if self._distributed:
            # Mirrored variables take plain assigns from replica context only.
            written = self.values.assign(tf.tensor_scatter_nd_update(self.values, index, row))
        else:
            written = self.values.scatter_nd_update(index, row)
        # The count is another resource: without this dependency it may advance
        # in a step that fails before its row is written.
        with tf.control_dependencies([written]):
            self.count.assign_add(1)

    def read_new(self):
        """Returns the rows written since the last read, oldest first, as a numpy array.

        Raises:
            RuntimeError: when more rows were written than the ring holds
                (the host read too rarely); the rows lost are counted.
        """
        count = int(self.count.numpy())
        fresh = count - self.read_count
        if fresh <= 0:
            return np.zeros((0, self.width), np.float32)
        if fresh > self.capacity:
            lost = fresh - self.capacity
            self.read_count = count - self.capacity
            raise RuntimeError(f"{lost} recorded steps were overwritten before being read.")
        values = self.values.numpy()
        slots = np.arange(self.read_count, count) % self.capacity
        self.read_count = count
        return values[slots]

    def skip_unread(self):
        """Marks every written row as read (for rows the host must not pair)."""
        self.read_count = int(self.count.numpy())


class _null_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Part:
    """Element `index` of `vector`: one value of a step that was computed
    with others in one op (the norms of all the variables of one update).

    Such values stay whole vectors until the row is written, so a row costs
    one gather however many variables there are, not one slice per column.
    """

    __slots__ = ("index", "vector")

    def __init__(self, vector, index):
        self.vector = vector
        self.index = index

    def tensor(self):
        return self.vector[self.index]


def scalar(value):
    """A step value as a scalar tensor (a `Part` sliced out of its vector)."""
    return value.tensor() if isinstance(value, Part) else value


def whole_vector(values):
    """The vector that `values` are all the parts of, in order, else None."""
    first = values[0] if values else None
    if isinstance(first, Part) and len(values) == int(first.vector.shape[0]) and all(
            isinstance(v, Part) and v.vector is first.vector and v.index == i for i, v in enumerate(values)):
        return first.vector
    return None


def vector_of(values):
    """One float32 1-D tensor of `values` (scalars and `Part`s), in order.

    A run of `Part`s that is a whole vector in order costs nothing; the rest
    is one stack of the scalars, one concat and one gather."""
    if not values:
        return tf.zeros([0], tf.float32)
    whole = whole_vector(values)
    if whole is not None:
        return tf.cast(whole, tf.float32)
    scalars, vectors, offsets, positions = [], [], {}, []
    for value in values:
        if isinstance(value, Part):
            key = id(value.vector)
            if key not in offsets:
                offsets[key] = len(vectors)
                vectors.append(tf.cast(value.vector, tf.float32))
            positions.append(("v", offsets[key], value.index))
        else:
            positions.append(("s", len(scalars), 0))
            scalars.append(tf.cast(value, tf.float32))
    if not vectors:
        return tf.stack(scalars)
    pieces = ([tf.stack(scalars)] if scalars else []) + vectors
    starts, start = [], len(scalars)
    for vector in vectors:
        starts.append(start)
        start += int(vector.shape[0])
    index = [which if kind == "s" else starts[which] + i for kind, which, i in positions]
    joined = tf.concat(pieces, axis=0)
    if index == list(range(start)):
        return joined  # every value in place: the row needs no gather
    return tf.gather(joined, tf.constant(index, tf.int32))
