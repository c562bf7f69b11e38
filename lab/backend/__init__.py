"""The backend part of the lab, picked once from Keras' backend.

As `keras/src/backend/__init__.py` picks one of `backend/{jax,tensorflow}/`,
this module imports one of `lab/backend/{tensorflow,jax}/`. Each subpackage
has the same module names (`compat`, `buffer`, `norms`, `probes`,
`recorder`, `devices`, ...) and exports the same names: the public ones
`lab/__init__.py` re-exports (a feature a backend does not have yet is
`lab.backend.unavailable`'s placeholder, which says so when used) and the
capability flags below. Shared code reads the flags, never the backend's
name.

Capability flags:
    NAME: str, Keras' backend (for run metadata and messages only).
    MODES: tuple of str, the execution modes `lab.set_mode` accepts.
    STATE_OUTSIDE_VARIABLES_DURING_FIT: bool, whether fit() keeps the
        training state outside the Keras variables while it runs (JAX's
        stateless step: `model.weights` are stale or empty between batches).
    HAS_REPLICA_CONTEXT: bool, whether a step runs once per replica with
        per-replica values (tf.distribute), rather than as one global
        program (JAX's SPMD).
    CALLBACKS_MAY_RUN_OFF_THREAD: bool, whether Keras may run batch-end
        callbacks on a thread pool.

`module(name)` is the backend's own module of that name (`pause`, `stepper`,
...), for shared code that needs more than the public names.
"""

import importlib

from lab import _versions

NAME = _versions.check()

if NAME == "tensorflow":
    from lab.backend.tensorflow import *  # noqa: F401,F403
    from lab.backend.tensorflow import __all__  # noqa: F401
elif NAME == "jax":
    from lab.backend.jax import *  # noqa: F401,F403
    from lab.backend.jax import __all__  # noqa: F401


def module(name):
    """The backend's own module `name`: `lab.backend.<NAME>.<name>`.

    Args:
        name: str, a module every backend has (`"pause"`, `"stepper"`, ...).
    """
    return importlib.import_module(f"{__name__}.{NAME}.{name}")
