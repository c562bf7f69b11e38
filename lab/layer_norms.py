"""layer_norms: a run's per-variable norms combined per layer or per part of a model."""

import numpy as np
import pandas as pd

from lab.variables import variable_keys


def layer_norms(run, parts=None, column="grad_norm", model=None):
    """Per-step norms of groups of variables, from a run's per-variable columns.

    A run holds one `<column>/<key>` column per variable, the key being the
    variable's path. Variables that share a path (namesakes, such as the
    copy `keras.models.clone_model` makes for an EMA network) are keyed `p`,
    `p#2`, `p#3`, ... by their position in the recorded model's
    `trainable_variables`. The norm of a group of variables together is the
    square root of the sum of their squared norms: the length of all their
    gradients as one vector. A step where none of a group's variables has a
    value stays NaN (missing, not 0).

    Args:
        run: `lab.Run` recorded with `gradients=True` (for
            `column="grad_norm"`), the DataFrame from `run.batches()`, or a
            `lab.StepTrace` (its one row).
        parts: None, or dict name -> what the part holds: a `keras.Layer` or
            `keras.Model` (exactly its trainable variables; a frozen one's
            variables, by their paths, namesakes included), a path prefix
            (`"decoder"` holds `decoder/...`, namesakes `#2`, ... included) or
            a column's key (`"net/d/kernel#2"`), or a list of those. None gives
            one column per layer: the key without its last path component
            (`trunk/kernel` -> `trunk`, `net/d/kernel#2` -> `net/d#2`).
        column: str, the per-variable column family, e.g. `"grad_norm"` or
            `"weight_norm"`.
        model: None, or the `keras.Model` the run recorded, whose
            `trainable_variables` tell which namesake keys are a part's. Needed
            where a layer or model in `parts` holds some, not all, of a set of
            namesakes (else that raises). With it, a part's variable that has
            no column (no gradient in a `StepTrace`) counts as missing.

    Returns:
        DataFrame indexed by `step`, one column per layer or part.

    Raises:
        ValueError: the run has no such columns; a part matches none of them;
            or a part holds some of a set of namesakes and no `model` says
            which.

    Example:

    ```python
    rec = lab.Recorder(gradients=True)
    vae.fit(x, epochs=2, callbacks=[rec])
    lab.layer_norms(rec.run, {"encoder": vae.encoder, "decoder": vae.decoder})
    # `model=` (the model the run recorded) tells namesake variables apart:
    # a network and its clone (keras.models.clone_model) share their paths.
    lab.layer_norms(rec.run, {"encoder": vae.encoder, "decoder": vae.decoder}, model=vae)
    ```
    """
    if hasattr(run, "batches"):
        rows = run.batches()
    elif hasattr(run, "row"):  # a StepTrace
        rows = pd.DataFrame([{**run.row, "step": run.index}])
    else:
        rows = run
    prefix = column + "/"
    paths = [c[len(prefix):] for c in rows.columns if c.startswith(prefix)]
    if not paths:
        raise ValueError(
            f"This run has no `{prefix}<variable>` columns. Record it with "
            f"`lab.Recorder(gradients=True)` (or `weights=True` for weight norms), "
            f"or pass the `column` it has.")
    if parts is None:
        groups = {}
        for path in paths:
            groups.setdefault(_layer_of(path), []).append(path)
    else:
        namesakes = _Namesakes(paths, parts, model)
        groups = {name: _paths_of(name, part, paths, namesakes) for name, part in parts.items()}
    steps = rows["step"].to_numpy() if "step" in rows else np.arange(len(rows))
    combined = {name: _combine(rows.reindex(columns=[prefix + p for p in members]).to_numpy(np.float64))
                for name, members in groups.items()}
    return pd.DataFrame(combined, index=pd.Index(steps, name="step"))


def _paths_of(name, part, paths, namesakes):
    members = []
    for item in _items(part):
        if isinstance(item, str):
            found = [p for p in paths if p == item or p.startswith(item.rstrip("/") + "/")]
        elif hasattr(item, "trainable_variables") and not item.trainable_variables and getattr(item, "weights", None):
            # Frozen since the run (fine-tuning done, the base frozen again):
            # its variables are matched by their paths, as a prefix is.
            own = {_path(v) for v in item.weights}
            found = [p for p in paths if _base(p) in own]
        elif hasattr(item, "trainable_variables"):
            found = namesakes.keys_of(name, item.trainable_variables)
        else:
            raise TypeError(
                f"Part {name!r}: expected a layer, a model, a path prefix or a list of "
                f"those, got {type(item).__name__}.")
        if not found:
            raise ValueError(
                f"Part {name!r} matches no variable of this run ({item!r}). "
                f"The run has: {', '.join(paths)}. Pass a layer or model that was "
                f"trained in it, or a prefix of one of these paths.")
        members += [p for p in found if p not in members]
    return members


def _items(part):
    return part if isinstance(part, (list, tuple)) else [part]


class _Namesakes:
    """Tells which of a run's keys are a layer's own.

    A run keys variables that share a path `p`, `p#2`, ... by position in the
    recorded model's `trainable_variables`, which a layer's own paths cannot
    express. Given that model, keys are computed as the run computed them
    (its variables first, in order). Without it, a layer takes every key of a
    path only where it holds all the variables of that path that the run or
    the other parts show; holding fewer is ambiguous, and raises.
    """

    def __init__(self, paths, parts, model):
        self.model = model
        self.recorded = {}
        for path in paths:
            self.recorded.setdefault(_base(path), []).append(path)
        self.seen = {}  # path -> ids of the variables the parts hold
        for part in parts.values():
            for item in _items(part):
                for variable in getattr(item, "trainable_variables", None) or []:
                    self.seen.setdefault(_path(variable), set()).add(id(variable))
        self._model_keys = None

    def keys_of(self, name, variables):
        if self.model is not None:
            return self._by_position(name, variables)
        held = {}
        for variable in variables:
            held.setdefault(_path(variable), set()).add(id(variable))
        ambiguous = [path for path, mine in held.items()
                     if len(mine) < max(len(self.recorded.get(path, [])), len(self.seen[path]))]
        if ambiguous:
            raise ValueError(
                f"Part {name!r} holds some, not all, of the variables named "
                f"{', '.join(repr(p) for p in ambiguous)}: a run keys such namesakes (as "
                f"`keras.models.clone_model` makes) `path`, `path#2`, ... by position in "
                f"the model's `trainable_variables`, which the part's paths cannot tell. "
                f"Pass the model the run recorded: `lab.layer_norms(run, parts, model=model)`, "
                f"or name a column's key (`{ambiguous[0]}#2`) as a part.")
        return [key for path in held for key in self.recorded.get(path, [])]

    def _by_position(self, name, variables):
        if self._model_keys is None:
            trainable = self.model.trainable_variables
            self._model_keys = variable_keys(trainable)
            self._counts = {}
            for variable in trainable:
                self._counts[_path(variable)] = self._counts.get(_path(variable), 0) + 1
        keys = []
        for variable in variables:
            path, key = _path(variable), self._model_keys.get(id(variable))
            recorded = self.recorded.get(path, [])
            if key is None and len(recorded) > 1:
                raise ValueError(
                    f"Part {name!r} holds a variable named {path!r} that is not among the "
                    f"model's `trainable_variables`, and the run has several keys of that "
                    f"path ({', '.join(recorded)}). Pass the model the run recorded, or name "
                    f"the key of the column you mean as a part.")
            if key is not None and len(recorded) > self._counts[path]:
                # Keys past the model's count number no variable of it: another
                # model, or one whose variables are trainable differently now.
                raise ValueError(
                    f"Part {name!r}: the run has {len(recorded)} keys of {path!r} "
                    f"({', '.join(recorded)}) and the model's `trainable_variables` only "
                    f"{self._counts[path]}. Pass the model the run recorded, with the "
                    f"variables trainable that were then.")
            if key is not None:
                keys.append(key)  # a variable without a column (no gradient in a trace) is missing
            elif path in recorded:
                keys.append(path)
        return keys


def _path(variable):
    return getattr(variable, "path", None) or variable.name


def _base(key):
    return key.split("#", 1)[0]


def _layer_of(key):
    # Namesake layers (`net/d/kernel`, `net/d/kernel#2`) stay apart: `net/d`, `net/d#2`.
    base, _, number = key.partition("#")
    layer = base.rsplit("/", 1)[0] if "/" in base else base
    return f"{layer}#{number}" if number else layer


def _combine(values):
    missing = np.isnan(values).all(axis=1)
    total = np.sqrt(np.nansum(np.square(values), axis=1))
    total[missing] = np.nan
    return total
