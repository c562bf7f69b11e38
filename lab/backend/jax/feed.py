"""Feed on JAX: the batches a Stepper hands to train_step, shaped as fit() shapes them.

Keras' JAX `fit()` hands `train_step` NumPy batches (checked with Keras
3.15): for arrays `(x, y)`, `(x, y, sample_weight)`, or the bare `x` when
there are no targets (`(x,)` when `x` is a list or tuple of several inputs),
float arrays cast to the backend's float type by Keras' own slicing; a
PyDataset's and a generator's batches as they come, a bare array from a
PyDataset as `(x,)`.

Arrays are batched here, sliced by Keras' own array slicing; with
`shuffle=True` each epoch's order is the next permutation of a
`numpy.random.RandomState(seed)` of the feed's own (fit() draws NumPy's
global permutations, one more when its first call builds the model's
compiled metrics, so its order is not one a seed names). A PyDataset's batch
order is shuffled with Python's `random`, as fit() shuffles it. Batches handed back by a rewind come out again first, so
every data form replays exactly. Nothing here imports TensorFlow.
"""

import collections
import itertools
import random

import jax
import keras
import numpy as np

from lab.backend.jax import compat
from lab.data_rules import ClassWeightError

Fed = collections.namedtuple("Fed", ["epoch", "batch", "data"])

DATA_TYPES = ("an array, a tuple (x, y) or (x, y, sample_weight) of arrays, a keras.utils.PyDataset "
              "or a generator of (x, y) tuples")


class Feed:
    """Yields `Fed(epoch, batch, data)` items; `data` is what train_step receives.

    Args:
        data: an array, a tuple `(x, y)` / `(x, y, sample_weight)` of arrays
            (x may be a list or dict of arrays), a `keras.utils.PyDataset`,
            or a generator or other iterable of batches.
        batch_size: int or None, for arrays (default 32).
        shuffle: bool, reshuffle arrays, and a PyDataset's batch order, every epoch.
        seed: int or None, seeds the shuffle.
        steps_per_epoch: int or None, batches per epoch.
        position: tuple (epoch, batch) of the first item.
        class_weight: dict or None, as `fit(class_weight=...)`.
    """

    def __init__(self, data, batch_size=None, shuffle=True, seed=None, steps_per_epoch=None,
                 position=(0, 0), class_weight=None):
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self._source = _source(data, batch_size, shuffle, seed, class_weight)
        self.order_note = self._source.order_note()
        self._replay = collections.deque()
        self._epoch, self._batch = (int(p) for p in position)
        self._iterator = None
        self._drawn = 0
        self._begun = None

    def next(self):
        """The next item: a replayed one if any, else a fresh batch."""
        if self._replay:
            return self._replay.popleft()
        while True:
            if self.steps_per_epoch is not None and self._batch >= self.steps_per_epoch:
                self._epoch, self._batch = self._epoch + 1, 0
            if self._begun != self._epoch:
                self._source.begin_epoch(self._epoch)
                self._begun = self._epoch
            if self._iterator is None:
                self._iterator, self._drawn = self._source.epoch(self._epoch), 0
            try:
                data = next(self._iterator)
            except StopIteration:
                if self._drawn == 0:
                    raise self._source.empty_error() from None
                if self._batch == 0:  # a pass carried over by steps_per_epoch ended: a new one
                    self._iterator = None
                    continue
                self._epoch, self._batch, self._iterator = self._epoch + 1, 0, None
                continue
            self._drawn += 1
            item = Fed(self._epoch, self._batch, data)
            self._batch += 1
            return item

    def push_back(self, items):
        """Puts items back so they come out next, in the given order."""
        for item in reversed(list(items)):
            self._replay.appendleft(item)


def to_numpy(structure):
    """Arrays in a nested structure -> NumPy arrays (None stays None)."""
    if structure is None:
        return None
    return keras.tree.map_structure(lambda leaf: None if leaf is None else np.asarray(leaf), structure)


def _source(data, batch_size, shuffle, seed, class_weight):
    if isinstance(data, keras.utils.PyDataset):
        return _PyDatasetSource(data, shuffle, seed, class_weight)
    if _is_arrays(data):
        return _ArraySource(data, batch_size, shuffle, seed, class_weight)
    if class_weight is not None:
        raise ClassWeightError(f"class_weight cannot weight the batches of a {type(data).__name__}: fit() refuses "
                               "it there too. Give the arrays as (x, y), or yield (x, y, sample_weight) batches.")
    if hasattr(data, "__next__"):
        return _OneShot(data)
    if hasattr(data, "__iter__") and not isinstance(data, (str, bytes, dict)):
        return _Reiterable(data)
    raise TypeError(f"Cannot step through data of type {type(data).__name__}. Pass what fit() takes: {DATA_TYPES}.")


def _is_arrays(data):
    if isinstance(data, tuple) and 1 <= len(data) <= 3:
        leaves = keras.tree.flatten(data)
    else:
        leaves = keras.tree.flatten(data) if isinstance(data, (list, dict)) else [data]
    return bool(leaves) and all((hasattr(leaf, "shape") and hasattr(leaf, "__array__")) or hasattr(leaf, "to_numpy")
                                for leaf in leaves)


class _Source:
    def begin_epoch(self, epoch):
        """Called as each epoch starts, before its first batch."""

    def order_note(self):
        """Why the batches cannot come in the order fit() trains on, or None."""
        return None


class _ArraySource(_Source):
    def __init__(self, data, batch_size, shuffle, seed, class_weight):
        if not (isinstance(data, tuple) and 1 <= len(data) <= 3):
            data = (data,)
        x, y, sample_weight = (tuple(data) + (None, None))[:3]
        if class_weight is not None:
            if y is None:
                raise ClassWeightError("class_weight weighs each sample by its class in y, and the data has no "
                                       "targets: give (x, y), as fit(x, y, class_weight=...) takes them.")
            if sample_weight is not None:
                raise ClassWeightError("The data holds sample weights and class_weight is given too, which fit() "
                                       "refuses: give one of them.")
            if keras.tree.is_nested(y):
                raise ClassWeightError("class_weight weighs the samples of a model with one output; these targets "
                                       f"are a {type(y).__name__} of several, as fit() refuses them too. Give each "
                                       "output's weights as sample weights instead: (x, y, sample_weight).")
            sample_weight = class_weights_as_sample_weights(y, class_weight)
        # fit(x) hands train_step the bare x; (x,) where x is a list or tuple.
        packed = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        lengths = sorted({int(np.shape(leaf)[0]) if np.ndim(leaf) else -1 for leaf in keras.tree.flatten(packed)})
        if len(lengths) != 1:
            described = ", ".join(
                f"{name} has {sorted({int(np.shape(leaf)[0]) for leaf in keras.tree.flatten(part)})} samples"
                for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)) if part is not None)
            raise ValueError(f"The arrays differ in length ({described}); give them the same first dimension.")
        self.count = lengths[0]
        if self.count <= 0:
            raise ValueError("The arrays hold no samples.")
        self.batch_size = 32 if batch_size is None else int(batch_size)
        self.sliceable = sliceable_arrays(packed)
        self.shuffle = shuffle
        # A permutation per epoch, as fit() draws (from NumPy's global generator).
        self.rng = np.random.RandomState(seed)

    def epoch(self, epoch):
        order = self.rng.permutation(self.count) if self.shuffle else None
        for start in range(0, self.count, self.batch_size):
            stop = min(start + self.batch_size, self.count)
            rows = slice(start, stop) if order is None else order[start:stop]
            yield slice_arrays(self.sliceable, rows)

    def empty_error(self):
        return ValueError("The arrays hold no samples.")


class _Reiterable(_Source):
    def __init__(self, data):
        self.data, self.kind = data, type(data).__name__

    def epoch(self, epoch):
        return (_as_batch(batch) for batch in iter(self.data))

    def empty_error(self):
        return ValueError(f"The {self.kind} yields no batches; give the Stepper data with at least one.")


class _OneShot(_Source):
    def __init__(self, iterator):
        self.iterator = iterator
        self.used = False

    def epoch(self, epoch):
        if self.used:
            raise ValueError(
                "The generator is exhausted: a generator runs through once. Pass "
                "steps_per_epoch=... to split it into epochs, or a keras.utils.PyDataset, "
                "which can be iterated again.")
        self.used = True
        return (_as_batch(batch) for batch in self.iterator)

    def empty_error(self):
        return ValueError("The generator yields no batches.")


class _PyDatasetSource(_Source):
    def __init__(self, dataset, shuffle, seed, class_weight):
        self.dataset = dataset
        self.class_weight = class_weight
        self.shuffle = shuffle
        self.seed = seed
        # Keras' PyDataset adapter shuffles with the global `random.shuffle`:
        # Random(seed) gives fit()'s order after keras.utils.set_random_seed(seed).
        self.random = random if seed is None else random.Random(seed)
        self.begun = False

    def order_note(self):
        if self.shuffle and self.seed is None and self.dataset.num_batches is not None:
            return ("The Stepper shuffles the PyDataset's batch order each epoch with Python's random, as "
                    "fit(shuffle=True) does: unseeded, that order is not the one another fit() trains on. "
                    "Pass seed=... to step the order fit() trains on after keras.utils.set_random_seed(seed), "
                    "or shuffle=False for the PyDataset's own order.")
        return None

    def begin_epoch(self, epoch):
        if self.begun:
            self.dataset.on_epoch_end()
        self.begun = True
        self.dataset.on_epoch_begin()

    def epoch(self, epoch):
        count = self.dataset.num_batches
        indices = itertools.count() if count is None else list(range(count))
        if count is not None and self.shuffle:
            self.random.shuffle(indices)
        for index in indices:
            try:
                batch = self.dataset[index]
            except IndexError:
                return
            yield self._standardized(batch)

    def _standardized(self, batch):
        if isinstance(batch, np.ndarray):
            batch = (batch,)
        if isinstance(batch, list):
            batch = tuple(batch)
        if self.class_weight is not None and isinstance(batch, tuple):
            if len(batch) == 3:
                raise ClassWeightError("The PyDataset's batches hold sample weights and class_weight is given "
                                       "too, which fit() refuses: give one of them.")
            if len(batch) == 2:
                batch = batch + (class_weights_as_sample_weights(batch[1], self.class_weight),)
        return _as_batch(batch)

    def empty_error(self):
        return ValueError("The PyDataset yields no batches.")


def _as_batch(batch):
    """A batch as Keras' JAX iterators hand it on: lists as tuples, leaves as
    NumPy arrays, in JAX's own dtypes where fit() puts batches on the device
    (`compat.batches_on_device`; the same values as a device would hold)."""
    if isinstance(batch, list):
        batch = tuple(batch)
    on_device = compat.batches_on_device()

    def leaf_of(leaf):
        if leaf is None or hasattr(leaf, "block_until_ready"):
            return leaf
        leaf = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)
        if on_device and leaf.dtype.kind in "biufc":
            leaf = leaf.astype(jax.dtypes.canonicalize_dtype(leaf.dtype), copy=False)
        return leaf
    return keras.tree.map_structure(leaf_of, batch)


# ---- Keras internals ----------------------------------------------------------
# Keras' own array slicing (keras/src/trainers/data_adapters, 3.11 to 3.15):
# the stepper slices arrays exactly as fit()'s ArrayDataAdapter slices them on
# JAX (float arrays cast to floatx, pandas and sparse inputs converted), so a
# stepped batch is the batch fit() trains on, bit for bit.

def sliceable_arrays(packed):
    """`packed` (what `pack_x_y_sample_weight` made) as Keras' sliceables for JAX."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.convert_to_sliceable(packed, target_backend="jax")


def slice_arrays(sliceable, rows):
    """The samples `rows` (a slice or indices) of each sliceable, as fit() hands them on JAX."""
    def take(leaf):
        return None if leaf is None else leaf.convert_to_jax_compatible(leaf[rows])

    # None (no targets, no sample weights) stays None; `none_is_leaf` is not in Keras 3.11.
    return keras.tree.map_structure(take, sliceable)


def class_weights_as_sample_weights(y, class_weight):
    """Each sample's class weight, computed by Keras' data adapters' own code
    (`class_weight_to_sample_weights`: class indices or one-hot targets)."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.class_weight_to_sample_weights(np.asarray(y), class_weight)
