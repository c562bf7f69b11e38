"""Feed: the batches a Stepper hands to train_step, shaped as fit() shapes them.

For arrays that is `(x, y)`, `(x, y, sample_weight)`, or the bare `x` when
there are no targets (checked with Keras 3.15: fit(x) passes x itself, a
dataset of 1-tuples passes `(x,)`); datasets and generators pass their
elements as they are, a PyDataset too but for a bare array, passed as `(x,)`.

Arrays are batched here (seeded shuffle per epoch); datasets, PyDatasets and
generators are iterated as fit() iterates them, a PyDataset's batch order
shuffled each epoch with Python's `random` as fit(shuffle=True) shuffles it.
Batches handed back by a rewind come out again first, so every data form
replays exactly.
"""

import collections
import itertools
import random

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from lab.backend.tensorflow import compat
from lab.data_rules import ClassWeightError

Fed = collections.namedtuple("Fed", ["epoch", "batch", "data"])

_END = (StopIteration, tf.errors.OutOfRangeError)


class Feed:
    """Yields `Fed(epoch, batch, data)` items; `data` is what train_step receives.

    Args:
        data: an array, a tuple `(x, y)` / `(x, y, sample_weight)` of arrays
            (x may be a list or dict of arrays), a `tf.data.Dataset`, a
            `keras.utils.PyDataset`, or a generator.
        batch_size: int or None, for arrays (default 32).
        shuffle: bool, reshuffle arrays, and a PyDataset's batch order, every epoch.
        seed: int or None, seeds the shuffle; None shuffles a PyDataset with
            Python's global `random`, as fit() does.
        steps_per_epoch: int or None, batches per epoch.
        position: tuple (epoch, batch) of the first item (to continue a fit()).
        class_weight: dict or None, as `fit(class_weight=...)`: each `(x, y)`
            batch gets its samples' class weights as its sample weights,
            computed by Keras' own data adapters' code.
    """

    def __init__(self, data, batch_size=None, shuffle=True, seed=None, steps_per_epoch=None,
                 position=(0, 0), class_weight=None):
        if steps_per_epoch is not None and int(steps_per_epoch) < 1:
            raise ValueError(f"steps_per_epoch must be at least 1, got {steps_per_epoch}.")
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self._source = _source(data, batch_size, shuffle, seed, class_weight)
        # Why the batches cannot come in the order fit() trains on, or None.
        self.order_note = self._source.order_note()
        self._replay = collections.deque()
        self._epoch, self._batch = (int(p) for p in position)
        self._iterator = None
        self._drawn = 0  # batches taken from the current iterator
        self._begun = None  # the epoch whose start the source was last told of

    def next(self):
        """The next item: a replayed one if any, else a fresh batch.

        Interrupted (Ctrl-C) once the batch is taken from the source, the
        batch is kept and comes next again: no batch is skipped.
        """
        if self._replay:
            item = self._replay[0]
            item = item._replace(data=self._as_step_input(item.data))  # one interrupted in `next` is raw
            self._replay.popleft()
            return item
        while True:
            if self.steps_per_epoch is not None and self._batch >= self.steps_per_epoch:
                self._end_epoch(keep_iterator=True)
            if self._begun != self._epoch:
                # fit() tells the data of every epoch, also where steps_per_epoch
                # carries one pass over the data into the next epoch.
                self._source.begin_epoch(self._epoch)
                self._begun = self._epoch
            if self._iterator is None:
                self._iterator, self._drawn = self._source.epoch(self._epoch), 0
            try:
                data = next(self._iterator)
            except _END:
                if self._drawn == 0:
                    raise self._source.empty_error(self._epoch) from None
                if self._batch == 0:
                    # The pass carried over ended with the last epoch: this
                    # epoch starts a new one, as fit() does.
                    self._iterator = None
                    continue
                self._end_epoch(keep_iterator=False)
                continue
            self._drawn += 1
            position = (self._epoch, self._batch)
            try:
                item = Fed(*position, self._as_step_input(data))
            except BaseException:
                self._replay.appendleft(Fed(*position, data))
                self._batch = position[1] + 1
                raise
            self._batch = position[1] + 1
            return item

    def signature(self, data):
        """What to trace a step on `data`, a batch of this feed, with: the
        shapes fit() traces its train function with, so that the Stepper's
        graph step is fit()'s program. fit() leaves the batch size of a
        dataset as the dataset declares it (`element_spec`), and unknown for
        a generator, a PyDataset, and arrays that end in a partial batch; a
        step traced on a batch of known size instead is free to fold it in,
        and a loss's mean ended an ulp away from fit()'s (a CycleGAN's). For
        a generator or a PyDataset fit() also leaves unknown every dimension
        its first two batches disagree on (padded sequences of another length
        per batch), so that one trace serves them all.
        Where the batch does not fit that signature, the batch itself."""
        spec = self._source.signature(data)
        try:
            tf.nest.assert_same_structure(spec, data)
            fits = all(not isinstance(leaf, tf.TensorSpec) or leaf.is_compatible_with(value)
                       for leaf, value in zip(tf.nest.flatten(spec), tf.nest.flatten(data)))
        except (TypeError, ValueError):
            fits = False
        return spec if fits else data

    def _as_step_input(self, data):
        return _as_step_input(data, floatx=self._source.FLOATX)

    def push_back(self, items):
        """Puts items back so they come out next, in the given order."""
        for item in reversed(list(items)):
            self._replay.appendleft(item)

    def _end_epoch(self, keep_iterator):
        # One statement: an interrupt between these left a new epoch on the
        # old, spent iterator ("The arrays hold no samples" ever after).
        self._epoch, self._batch, self._iterator = self._epoch + 1, 0, (self._iterator if keep_iterator else None)


def to_numpy(structure):
    """Tensors in a nested structure -> numpy arrays (None stays None); a
    tf.RaggedTensor -> its `numpy()`, an object array of one array per row."""
    if structure is None:
        return None

    def leaf(t):
        if t is None:
            return None
        if isinstance(t, tf.RaggedTensor):  # np.asarray wraps it whole in a 0-d object array
            return t.numpy()
        return np.asarray(tf.sparse.to_dense(t) if isinstance(t, tf.SparseTensor) else t)

    return keras.tree.map_structure(leaf, structure)


def _as_step_input(data, floatx=False):
    """fit() passes tuples; lists become tuples, numpy leaves become tensors,
    float ones of the backend's float type with `floatx` (fit() casts arrays,
    and hands a generator's or a PyDataset's float64 batches on as float64)."""
    if isinstance(data, list):
        data = tuple(data)
    cast = _floatx if floatx else np.asarray
    return keras.tree.map_structure(
        lambda leaf: leaf if leaf is None or tf.is_tensor(leaf) else tf.convert_to_tensor(cast(leaf)), data
    )


def _any_batch_size(data):
    """`data` with each dense tensor's first dimension left unknown."""
    def relaxed(leaf):
        if isinstance(leaf, tf.Tensor) and leaf.shape.rank:
            return tf.TensorSpec([None] + leaf.shape.as_list()[1:], leaf.dtype)
        if isinstance(leaf, tf.SparseTensor):
            return tf.SparseTensorSpec([None] + leaf.shape.as_list()[1:], leaf.dtype)
        return leaf

    return keras.tree.map_structure(relaxed, data)


# fit() takes the shapes of a generator's or PyDataset's batches from its
# first two (Keras' data_adapter_utils.NUM_BATCHES_FOR_TENSOR_SPEC, 3.5 to 3.15).
_BATCHES_FOR_SIGNATURE = 2


def _merged_signature(batches, data):
    """What fit() traces a generator's or PyDataset's batches with (Keras'
    `get_tensor_spec` on `batches`, its first ones): the batch size and every
    dimension the batches disagree on left unknown. `data` (a batch) with only
    its batch size unknown where the batches do not share one structure."""
    def merged(*leaves):
        first = leaves[0]
        if not (isinstance(first, tf.Tensor) and first.shape.rank):
            return first
        if not all(isinstance(leaf, tf.Tensor) and leaf.shape.rank == first.shape.rank for leaf in leaves):
            return _any_batch_size(first)
        dims = [sizes[0] if len(set(sizes)) == 1 else None
                for sizes in zip(*(leaf.shape.as_list() for leaf in leaves))]
        return tf.TensorSpec([None] + dims[1:], first.dtype)

    try:
        return keras.tree.map_structure(merged, *[_as_step_input(batch) for batch in batches])
    except (TypeError, ValueError):
        return _any_batch_size(data)


def _floatx(value):
    array = np.asarray(value)
    if array.dtype.kind == "f" and array.dtype != np.dtype(keras.backend.floatx()):
        # fit() casts float arrays to the backend float type.
        return array.astype(keras.backend.floatx())
    return array


def _source(data, batch_size, shuffle, seed, class_weight=None):
    if isinstance(data, tf.data.Dataset):
        if class_weight is not None:
            # As fit() weights a dataset's batches; a batch with sample weights
            # already, or several targets, is refused here, as fit() refuses it.
            try:
                data = data.map(compat.class_weight_map_fn(class_weight))
            except ValueError as error:  # Keras' own words, as fit() raises them
                raise ClassWeightError(str(error)) from None
        return _Reiterable(lambda: iter(data), "tf.data.Dataset", spec=data.element_spec)
    if isinstance(data, keras.utils.PyDataset):
        return _PyDatasetSource(data, shuffle, seed, class_weight)
    if _is_arrays(data):
        return _ArraySource(data, batch_size, shuffle, seed, class_weight)
    if class_weight is not None and (hasattr(data, "__next__") or hasattr(data, "__iter__")):
        raise ClassWeightError(
            f"class_weight cannot weight the batches of a {type(data).__name__}: fit() refuses it there too. "
            "Give the arrays as (x, y) or a tf.data.Dataset, or yield (x, y, sample_weight) batches with each "
            "sample's class weight."
        )
    if hasattr(data, "__next__"):
        return _OneShot(data)
    if hasattr(data, "__iter__") and not isinstance(data, (str, bytes, dict)):
        return _Reiterable(lambda: iter(data), type(data).__name__)
    raise TypeError(
        f"Cannot step through data of type {type(data).__name__}. Pass what fit() takes: "
        "an array, a tuple (x, y) or (x, y, sample_weight) of arrays, a tf.data.Dataset, "
        "a keras.utils.PyDataset or a generator of (x, y) tuples."
    )


def _is_arrays(data):
    if isinstance(data, tuple) and 1 <= len(data) <= 3:
        leaves = keras.tree.flatten(data)
    else:
        leaves = keras.tree.flatten(data) if isinstance(data, (list, dict)) else [data]
    return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "__array__") or
                                hasattr(leaf, "to_numpy") or isinstance(leaf, tf.SparseTensor) for leaf in leaves)


def _host_array(leaf):
    """An array leaf as the feed slices it: NumPy, or a tf.SparseTensor's entries on the host."""
    return _HostSparse(leaf) if isinstance(leaf, tf.SparseTensor) else np.asarray(leaf)


class _HostSparse:
    """A tf.SparseTensor's entries, read to the host once: each batch takes its rows from them."""

    def __init__(self, sparse):
        self.indices, self.values = sparse.indices.numpy(), sparse.values.numpy()
        self.shape = tuple(int(d) for d in sparse.dense_shape)

    def rows(self, rows):
        """A SparseTensor of the samples `rows` (indices, in order), its entries
        in row-major order, as fit()'s batches of it are."""
        position = np.full(self.shape[0], -1)
        position[rows] = np.arange(len(rows))
        kept = position[self.indices[:, 0]] >= 0
        moved = np.concatenate([position[self.indices[kept, 0]][:, None], self.indices[kept, 1:]], axis=1)
        order = np.lexsort(moved.T[::-1])
        return tf.SparseTensor(moved[order], self.values[kept][order], (len(rows),) + self.shape[1:])


def _rows_of(leaf, rows):
    """The samples `rows` (indices, in order) of an array leaf as `_host_array` keeps it."""
    return leaf.rows(rows) if isinstance(leaf, _HostSparse) else leaf[rows]


def sample_count(array):
    """The number of samples (rows) of an array, of a tf.SparseTensor or a tf.RaggedTensor too."""
    if isinstance(array, tf.RaggedTensor):  # which has no len()
        return int(array.nrows())
    return int(array.shape[0]) if isinstance(array, tf.SparseTensor) else len(array)


def row_slice(array, start, stop):
    """Samples `start` to `stop` of an array; of a tf.SparseTensor, a SparseTensor."""
    if isinstance(array, tf.SparseTensor):
        shape = array.shape.as_list()
        return tf.sparse.slice(array, [start] + [0] * (len(shape) - 1), [stop - start] + shape[1:])
    return array[start:stop]


class _Source:
    FLOATX = False  # whether fit() casts float batches to the backend's float type

    def begin_epoch(self, epoch):
        """Called as each epoch starts, before its first batch."""

    def order_note(self):
        """Why the batches cannot come in the order fit() trains on, or None."""
        return None


class _ArraySource(_Source):
    FLOATX = True  # Keras' array slicing casts float arrays to floatx

    def __init__(self, data, batch_size, shuffle, seed, class_weight=None):
        if not (isinstance(data, tuple) and 1 <= len(data) <= 3):
            data = (data,)
        data = tuple(d for d in data if d is not None) if data[-1] is None else data
        if class_weight is not None:
            data = _class_weighted(data, class_weight)
        self.data = keras.tree.map_structure(_host_array, data)
        lengths = {}
        for name, part in zip(("x", "y", "sample_weight"), self.data):
            for leaf in keras.tree.flatten(part):
                lengths.setdefault(name, set()).add(int(leaf.shape[0]) if leaf.shape else len(leaf))
        sizes = {n: sorted(s) for n, s in lengths.items()}
        if len({v for s in sizes.values() for v in s}) != 1:
            described = ", ".join(f"{n} has {s[0] if len(s) == 1 else s} samples" for n, s in sizes.items())
            raise ValueError(f"The arrays differ in length ({described}); give them the same first dimension.")
        self.count = next(iter(sizes["x"]))
        if self.count == 0:
            raise ValueError("The arrays hold no samples.")
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        self.batch_size = 32 if batch_size is None else int(batch_size)
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)

    def signature(self, data):
        # fit()'s array adapter knows the batch size where every batch is whole.
        return data if self.count % self.batch_size == 0 else _any_batch_size(data)

    def epoch(self, epoch):
        order = self.rng.permutation(self.count) if self.shuffle else np.arange(self.count)
        for start in range(0, self.count, self.batch_size):
            rows = order[start:start + self.batch_size]
            batch = keras.tree.map_structure(lambda a: _rows_of(a, rows), self.data)
            # fit(x) without targets hands train_step the bare x, not (x,) --
            # unless x is a list or tuple (several inputs): then (x,), so that
            # fit([x, y]) means two inputs and no targets, never (x, y).
            bare = len(batch) == 1 and not isinstance(batch[0], (list, tuple))
            yield batch[0] if bare else batch

    def empty_error(self, epoch):
        return ValueError("The arrays hold no samples.")


def _class_weighted(data, class_weight):
    """Arrays `(x, y)` with each sample's class weight as its sample weight, as fit()'s array adapter weights them."""
    if len(data) < 2:
        raise ClassWeightError("class_weight weighs each sample by its class in y, and the data has no targets: "
                               "give (x, y), as fit(x, y, class_weight=...) takes them.")
    if len(data) == 3:
        raise ClassWeightError("The data holds sample weights and class_weight is given too, which fit() refuses: "
                               "give one of them (the sample weights may include the class weights).")
    if keras.tree.is_nested(data[1]):
        raise ClassWeightError("class_weight weighs the samples of a model with one output; these targets are "
                               f"a {type(data[1]).__name__} of several, as fit() refuses them too. Give each output's "
                               "weights as sample weights instead: (x, y, sample_weight).")
    y = data[1].to_numpy() if hasattr(data[1], "to_numpy") else np.asarray(data[1])
    return data + (compat.class_weights_as_sample_weights(y, class_weight),)


class _Reiterable(_Source):
    def __init__(self, make, kind, spec=None):
        self.make, self.kind, self.spec = make, kind, spec

    def signature(self, data):
        return _any_batch_size(data) if self.spec is None else self.spec

    def epoch(self, epoch):
        return self.make()

    def empty_error(self, epoch):
        return ValueError(f"The {self.kind} yields no batches; give the Stepper data with at least one.")


class _PyDatasetSource(_Source):
    def __init__(self, dataset, shuffle, seed, class_weight=None):
        self.dataset = dataset
        self.class_weight = class_weight
        # Keras' PyDatasetAdapter shuffles with the global `random.shuffle`, so
        # a Random(seed) gives the order fit() trains on after
        # keras.utils.set_random_seed(seed) (which seeds Python's random).
        self.shuffle = shuffle
        self.seed = seed
        self.random = random if seed is None else random.Random(seed)
        self.spec = None
        self.begun = False  # whether an epoch was begun: the next begins after an end

    def order_note(self):
        if not self.shuffle or self.dataset.num_batches is None:
            return None  # fit() never shuffles an endless PyDataset
        if not compat.PYDATASET_SHUFFLE_IS_PYTHON_RANDOM:
            return (
                f"fit(shuffle=True) on Keras {keras.__version__} also passes a PyDataset's batches through "
                "a tf.data shuffle buffer, an order the Stepper cannot step: it shuffles the batch order "
                "each epoch with Python's random, as Keras 3.6 and later do. Pass shuffle=False to both "
                "fit() and the Stepper to step the batches fit() trains on."
            )
        if self.seed is None:
            return (
                "The Stepper shuffles the PyDataset's batch order each epoch with Python's random, as "
                "fit(shuffle=True) does: unseeded, that order is not the one another fit() trains on. "
                "Pass seed=... to step the order fit() trains on after keras.utils.set_random_seed(seed), "
                "or shuffle=False for the PyDataset's own order."
            )
        return None

    def signature(self, data):
        if self.spec is None:
            # As fit() does, from batches 0 and 1, whatever the order stepped.
            count = self.dataset.num_batches
            first = []
            for index in range(_BATCHES_FOR_SIGNATURE if count is None else min(count, _BATCHES_FOR_SIGNATURE)):
                try:
                    first.append(self._batch(index))
                except IndexError:
                    break
            self.spec = _merged_signature(first, data) if first else _any_batch_size(data)
        return self.spec

    def begin_epoch(self, epoch):
        # As fit() calls them, around each epoch; before the first, as fit()'s
        # reset of its iterator does (Keras 3.7 on), whatever epoch it starts at.
        if self.begun or compat.FIT_ENDS_AN_EPOCH_BEFORE_THE_FIRST:
            self.dataset.on_epoch_end()
        self.begun = True
        self.dataset.on_epoch_begin()

    def epoch(self, epoch):
        count = self.dataset.num_batches
        if count is None:
            indices = itertools.count()
        else:
            indices = list(range(count))
            if self.shuffle:
                self.random.shuffle(indices)  # as fit()'s adapter, as a pass starts
        for index in indices:
            try:
                batch = self._batch(index)
            except IndexError:
                return
            yield batch

    def _batch(self, index):
        batch = _from_pydataset(self.dataset[index])
        if self.class_weight is not None and isinstance(batch, (tuple, list)):
            batch = tuple(batch)
            # As Keras' PyDataset adapter weighs a batch (x, y); (x,) stays as it is.
            if len(batch) == 3:
                raise ClassWeightError("The PyDataset's batches hold sample weights and class_weight is given too, "
                                       "which fit() refuses: give one of them.")
            if len(batch) == 2:
                batch = batch + (compat.class_weights_as_sample_weights(batch[1], self.class_weight),)
        return batch

    def empty_error(self, epoch):
        return ValueError("The PyDataset yields no batches.")


def _from_pydataset(batch):
    # fit() hands a bare array from a PyDataset as (x,), as Keras' adapter does.
    return (batch,) if isinstance(batch, np.ndarray) else batch


class _OneShot(_Source):
    def __init__(self, iterator):
        self.iterator = iterator
        self.used = False
        self.first = []  # its first batches, as fit() peeks at them for its signature
        self.ahead = collections.deque()  # batches taken for the signature, not yet yielded
        self.spec = None

    def signature(self, data):
        if self.spec is None:
            while len(self.first) < _BATCHES_FOR_SIGNATURE:
                try:
                    batch = next(self.iterator)
                except _END:
                    break
                self.first.append(batch)
                self.ahead.append(batch)
            self.spec = _merged_signature(self.first, data)
        return self.spec

    def _batches(self):
        while True:
            if self.ahead:
                yield self.ahead.popleft()
                continue
            try:
                batch = next(self.iterator)
            except _END:
                return
            if len(self.first) < _BATCHES_FOR_SIGNATURE:
                self.first.append(batch)
            yield batch

    def epoch(self, epoch):
        if self.used:
            raise ValueError(
                "The generator is exhausted: a generator runs through once. Pass "
                "steps_per_epoch=... to split it into epochs, or a tf.data.Dataset or "
                "keras.utils.PyDataset, which can be iterated again."
            )
        self.used = True
        return self._batches()

    def empty_error(self, epoch):
        return ValueError("The generator yields no batches.")


# ---- a copy of a pipeline to read -------------------------------------------

# Dataset ops whose state is a resource input (its index): a copy of the
# pipeline gets fresh ones, so that reading it leaves the user's untouched.
_OWN_STATE = {"ShuffleDatasetV3": (4, "DummySeedGenerator"), "ShuffleAndRepeatDatasetV2": (5, "DummySeedGenerator"),
              "CacheDatasetV2": (2, "DummyMemoryCache")}
# The copy serializes the arrays a pipeline holds (from_tensor_slices): several
# copies of them at once (400 MB took 4 GB and 4 s); above this the dataset itself is read.
COPY_LIMIT = 256 * 2**20
# Ops that change variables as a pipeline runs (Keras' random preprocessing layers, tf.random.Generator).
_CHANGES_VARIABLES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "RngReadAndSkip", "RngSkip",
                      "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormalV2",
                      "StatefulTruncatedNormal")


def reading_copy(dataset):
    """What the lab reads of a user's `tf.data.Dataset` outside training
    (inspect_data, compare_modes): `(dataset to read, notes, caches)`.

    Where the pipeline shuffles or caches, the dataset to read is a copy of
    it with its own shuffle seeds and in-memory caches, so that reading it
    changes nothing fit() then reads. Reading the dataset itself did:

    - a `shuffle(seed=...)` that reshuffles each iteration draws its next
      order for every iterator made, so fit() trained on another order than
      without the lab's read (TensorFlow 2.16 and 2.21);
    - a cache read in part is left half written when the iterator goes:
      TensorFlow drops it, or, where a prefetch or a parallel map ran ahead
      (text_dataset_from_directory(...).cache().prefetch(), about one time
      in thirty), keeps it as if whole, and fit() saw only the batches read
      so far.

    `caches` are those to fill before reading in part (`read_through`): a
    file cache, shared through its file. Where the pipeline holds more than
    `COPY_LIMIT` of arrays, or TensorFlow refuses to serialize it, the
    dataset itself is read, its caches are all to fill, and a note says the
    shuffle moved on. A note also names the variables a pipeline's
    functions change as they run (their draws move on either way)."""
    steps = _steps(dataset)
    notes = _variable_change_notes(steps)
    kinds = {type(step).__name__ for step in steps}
    if not kinds & {"_ShuffleDataset", "CacheDataset"}:
        return dataset, notes, []
    caches = [step for step in steps if type(step).__name__ == "CacheDataset"]
    held = sum(_nbytes(tensor) for step in steps for tensor in tf.nest.flatten(getattr(step, "_tensors", ())))
    try:
        if held > COPY_LIMIT:
            raise ValueError(f"it holds {held / 2**20:.0f} MB of arrays")
        copy = _copy_with_own_state(dataset)
    except (tf.errors.OpError, ValueError, TypeError) as error:
        if "_ShuffleDataset" in kinds:
            notes.append(f"the lab did not copy the pipeline ({compat.error_line(error)}) and read the dataset itself: "
                         "a shuffle(seed=...) now gives fit() its next order, not its first.")
        return dataset, notes, caches
    return copy, notes, [cache for cache in caches if cache._filename.numpy()]


def read_through(dataset, caches):
    """Reads `dataset` through once where it holds `caches` and its length
    is known, filling them as fit()'s first epoch does; True if it did.
    A pipeline's own error (tf.errors.OpError) is raised."""
    if not caches or int(dataset.cardinality()) < 0:
        return False
    for _ in dataset:
        pass
    return True


def _copy_with_own_state(dataset):
    graph = graph_pb2.GraphDef.FromString(tf.raw_ops.DatasetToGraphV2(
        input_dataset=dataset._variant_tensor, external_state_policy=1).numpy())  # 1: IGNORE, shared as handles
    for node in list(graph.node):
        if node.op in _OWN_STATE:
            index, op = _OWN_STATE[node.op]
            fresh = graph.node.add(name=f"{node.name}/own_state", op=op)
            node.input[index] = fresh.name
    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def _steps(dataset):
    """The datasets a pipeline is made of, `dataset` first (not those made inside its functions)."""
    found, stack = [], [dataset]
    while stack:
        node = stack.pop()
        found.append(node)
        try:
            stack.extend(node._inputs())
        except (AttributeError, NotImplementedError, TypeError):
            continue
    return found


def _nbytes(tensor):
    try:
        return tensor.shape.num_elements() * tensor.dtype.size
    except (AttributeError, TypeError):  # strings: no fixed size
        return 0


def _variable_change_notes(steps):
    ops = set()
    for step in steps:
        for attribute in ("_map_func", "_predicate", "_func"):
            function = getattr(getattr(step, attribute, None), "function", None)
            if function is None:
                continue
            graph = function.graph.as_graph_def()
            ops.update(node.op for node in graph.node)
            ops.update(node.op for library in graph.library.function for node in library.node_def)
    changes = sorted(ops.intersection(_CHANGES_VARIABLES))
    if not changes:
        return []
    return [f"the pipeline changes variables as it runs ({', '.join(changes)}: random preprocessing layers, "
            "a tf.random.Generator): the lab's read moved them on, so fit()'s draws are not those it would "
            "have made without it."]
