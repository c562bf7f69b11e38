"""load_weights_checked: Keras weight files loaded all or nothing.

Keras 3's `model.load_weights` names the layers whose variables do not fit,
but it has already assigned every layer that did: the model is left half
loaded. A file saved from a bigger model loads without a word, the layers
the model lacks silently ignored. And the optimizer state in the file is
skipped, with only a warning, unless the optimizer was built before the
load. This module closes the three gaps.
"""

import os
import zipfile


def load_weights_checked(model, path):
    """Loads `.weights.h5` or `.keras` weights into `model`, all or nothing.

    The model's optimizer, if it has one, is built first, so the optimizer
    state saved in the file (slots, iterations) is loaded, not skipped.

    Args:
        model: keras.Model, built, with the architecture the file was saved from.
        path: str or os.PathLike, a `.weights.h5` or `.keras` file.

    Raises:
        ValueError: a layer's variables do not match the file (Keras' message,
            which names the layers, is kept), or the file holds weights of
            layers the model does not have. The model is left as it was.

    Example:

    ```python
    lab.load_weights_checked(model, "best.weights.h5")
    ```
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No weights file at {path!r}.")
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    saved = [v.numpy() for v in variables]
    try:
        model.load_weights(path)
        arrays, groups = _layer_arrays(path)
        if arrays is not None and arrays > len(model.weights):
            raise ValueError(
                f"{path!r} holds {arrays} layer weight arrays but model {model.name!r} has "
                f"{len(model.weights)} weights: it was saved from a bigger model, and Keras "
                f"would ignore the rest. Layers in the file: {groups}. Build the model the "
                "file was saved from."
            )
    except ValueError as error:
        for variable, value in zip(variables, saved):
            variable.assign(value)
        raise ValueError(f"{error}\n\nNothing was loaded: model {model.name!r} is unchanged.") from None


def _layer_arrays(path):
    """(count, group names) of the layer weight arrays in a weights file, or (None, None)."""
    import h5py

    if path.endswith(".keras"):
        with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as member:
            with h5py.File(member, "r") as f:
                return _count(f)
    if path.endswith(".weights.h5"):
        with h5py.File(path, "r") as f:
            return _count(f)
    return None, None


def _count(f):
    import h5py

    # Optimizer state sits under the attribute holding the optimizer
    # ("optimizer/vars/0"); layer weights under "layers/..." or "vars/...".
    names = []
    f.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
    arrays = [n for n in names if n.startswith(("layers/", "vars/")) or "/layers/" in n]
    groups = sorted({n.rsplit("/vars/", 1)[0] for n in arrays})
    return len(arrays), groups
