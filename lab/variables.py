"""How the lab names variables and optimizers: pure Keras, on any backend.

`variable_keys` gives each variable the key its columns are named by
(`grad_norm/<key>`, `weight_norm/<key>`); `find_optimizers` the optimizers a
model holds, named by the attribute holding them.
"""

import keras


def variable_keys(variables):
    """Maps each variable (by id) to its path, with `#2`, `#3`, ... for repeats."""
    keys, seen = {}, {}
    for variable in variables:
        path = getattr(variable, "path", None) or variable.name
        seen[path] = seen.get(path, 0) + 1
        keys[id(variable)] = path if seen[path] == 1 else f"{path}#{seen[path]}"
    return keys


def find_optimizers(model):
    """The optimizers that may update `model`, named by the attribute holding them.

    A model whose custom `compile()` keeps its own optimizers (`d_opt`,
    `g_opt`) still gets a default `model.optimizer`; it is listed too, and
    simply never produces a row value when it does not update.
    """
    found = {}
    for name, value in vars(model).items():
        if isinstance(value, keras.optimizers.Optimizer) and name != "_optimizer":
            found[name] = value
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and all(
        optimizer is not o for o in found.values()
    ):
        found = {"optimizer": optimizer, **found}
    return found
