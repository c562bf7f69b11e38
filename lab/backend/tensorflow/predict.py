"""predict_stream: per-batch predictions with memory bounded by one batch.

`model.predict` concatenates every batch's output before it returns, so its
memory grows with the data set. `predict_stream` hands each batch's output to
the caller (or to a collector) and keeps nothing, calling the model's own
`predict_step` through a `tf.function` built once per model and execution mode.
"""

import itertools
import weakref

import keras
import numpy as np
import tensorflow as tf

from lab.arguments import check_predict_stream_options
from lab.backend.tensorflow.compat import reduce_per_replica
from lab.backend.tensorflow.devices import split_over_replicas, splits_batches
from lab.backend.tensorflow.feed import row_slice

# model -> ((run_eagerly, jit_compile), function); kept off the model, which
# the lab leaves as it found it, and weak so the model can be collected.
_FUNCTIONS = weakref.WeakKeyDictionary()


def predict_stream(model, data, batch_size=32, collect=None, steps=None):
    """Predicts batch by batch, yielding each batch's predictions as numpy.

    Only one batch of inputs and outputs is alive at a time (plus what the
    caller keeps), whatever the size of `data`. A model built under a
    MirroredStrategy with several replicas is predicted as `model.predict`
    predicts it: each batch split over the replicas, each replica's share
    with that replica's copy of the variables (BatchNormalization's moving
    statistics differ between replicas, each updating its own from its
    share of the batches in training). Under other strategies (TPUs,
    several workers) it is predicted on one device, with the first
    replica's copy of each variable.

    Args:
        model: keras.Model, built or buildable on the data.
        data: the inputs, in one of these forms:
            a numpy array, a tf.Tensor, or a list / tuple / dict of them for a
            multi-input model (sliced into batches of `batch_size`); a
            `tf.data.Dataset`, a `keras.utils.PyDataset`, a generator or any
            other iterable yielding batches, as `model.predict` takes them (`x`,
            `(x,)` or `(x, y)`; `y` is ignored by the model's `predict_step`).
        batch_size: int, samples per batch for arrays; batched inputs keep
            their own batches.
        collect: callable or None. When given, every batch is predicted here
            and `collect(y_pred, batch)` is called per batch, `batch` being
            the inputs as fed (for arrays the slice of `x`; otherwise the
            element yielded by `data`, labels included).
        steps: int or None, stop after this many batches (for endless
            generators).

    Returns:
        Without `collect`: a generator of per-batch predictions (numpy arrays,
        or the structure of arrays the model outputs). With `collect`: the
        number of samples predicted.

    Example:

    ```python
    total = 0
    for y_pred in lab.predict_stream(model, x_big, batch_size=1024):
        total += (y_pred.argmax(-1) == 3).sum()
    ```
    """
    check_predict_stream_options(model, batch_size, steps, collect)
    batches = _batches(data, int(batch_size), steps)
    stream = _predict(model, batches)
    if collect is None:
        return _predictions_only(stream)
    samples = 0
    for y_pred, batch in stream:
        collect(y_pred, batch)
        samples += len(tf.nest.flatten(y_pred)[0])
    return samples


def _predict(model, batches):
    """Yields (y_pred, batch as the user gave it)."""
    step = None
    strategy = model.distribute_strategy
    for fed, batch in batches:
        if step is None:
            step = predict_function(model)
        if splits_batches(strategy):
            fed, _ = split_over_replicas(strategy, fed)
        y_pred = tf.nest.map_structure(_to_numpy, step(fed))
        yield y_pred, batch


def _predictions_only(stream):
    for y_pred, _ in stream:
        yield y_pred


def predict_function(model):
    """The model's `predict_step` as a tf.function, built once per execution mode.

    Follows `model.run_eagerly` (plain Python calls) and `model.jit_compile`.

    Args:
        model: keras.Model.

    Returns:
        callable, `function(data) -> y_pred`, `data` as `predict_step` takes it.
    """
    key = (bool(model.run_eagerly), bool(model.jit_compile) if getattr(model, "compiled", False) else False)
    cached = _FUNCTIONS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    owner = weakref.ref(model)

    def one_step(data):
        model = owner()
        strategy = model.distribute_strategy
        if not splits_batches(strategy):
            return model.predict_step(data)
        # As model.predict runs it: each replica on its share, the shares joined in batch order.
        return reduce_per_replica(strategy.run(model.predict_step, args=(data,)), strategy, reduction="concat")

    if not key[0]:
        one_step = tf.function(one_step, reduce_retracing=True, jit_compile=key[1], autograph=False)
    _FUNCTIONS[model] = (key, one_step)
    return one_step


def _to_numpy(value):
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _is_array(value):
    return isinstance(value, (np.ndarray, tf.Tensor, tf.SparseTensor)) or (
        hasattr(value, "__array__") and hasattr(value, "shape") and not isinstance(value, tf.data.Dataset)
    )


def _is_array_structure(data):
    leaves = tf.nest.flatten(data) if isinstance(data, (list, tuple, dict)) else [data]
    return bool(leaves) and all(_is_array(leaf) for leaf in leaves)


def _batches(data, batch_size, steps=None):
    """Yields (what predict_step is fed, the batch as the user gave it), up to `steps`."""
    if isinstance(data, keras.utils.PyDataset):  # it stops itself, to end its epoch
        return ((batch, batch) for batch in _py_dataset_batches(data, steps))
    batches = _unbounded_batches(data, batch_size)
    return batches if steps is None else itertools.islice(batches, int(steps))


def _unbounded_batches(data, batch_size):
    if isinstance(data, tf.data.Dataset):
        return ((element, element) for element in data)
    if _is_array_structure(data):
        return _array_batches(data, batch_size)
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"predict_stream() cannot read data of type {type(data).__name__}. Pass a numpy "
            "array (or a list/dict of arrays), a tf.data.Dataset, a keras.utils.PyDataset "
            "or a generator yielding batches."
        )
    return ((element, element) for element in data)


def _py_dataset_batches(dataset, steps=None):
    """Each batch made once (a PyDataset may augment at random), up to
    `num_batches`, which is None for an endless one (Keras' own reading),
    or `steps`; between the dataset's `on_epoch_begin` and `on_epoch_end`,
    as `model.predict` calls them (a PyDataset may ready or wind up a pass there)."""
    count = dataset.num_batches
    if steps is not None:
        count = int(steps) if count is None else min(count, int(steps))
    dataset.on_epoch_begin()
    for index in itertools.count() if count is None else range(count):
        yield dataset[index]
    dataset.on_epoch_end()


def _floatx(array):
    floatx = keras.backend.floatx()
    if tf.is_tensor(array):
        return tf.cast(array, floatx) if array.dtype.is_floating and array.dtype != floatx else array
    array = np.asarray(array)
    return array.astype(floatx) if array.dtype.kind == "f" and array.dtype != np.dtype(floatx) else array


def _array_batches(data, batch_size):
    leaves = tf.nest.flatten(data)
    count = int(leaves[0].shape[0])
    for leaf in leaves[1:]:
        if int(leaf.shape[0]) != count:
            raise ValueError(
                f"All input arrays need the same number of samples; got {count} and "
                f"{int(leaf.shape[0])}."
            )

    def slices():
        for start in range(0, count, batch_size):
            # A slice is a view: no copy of the data set is made.
            x = tf.nest.map_structure(lambda a: row_slice(a, start, start + batch_size), data)
            # As Keras' array adapter does: a tuple, so a list of inputs is
            # never read as (x, y) by predict_step; float arrays cast to the
            # backend's float type (`model.predict` casts them, a generator's
            # batches it hands on as they are).
            yield (tf.nest.map_structure(_floatx, x),), x

    return slices()
