"""Devices and data parallelism on JAX: what `jax.devices()` lists, virtual
CPU devices, and `keras.distribution.DataParallel` over a chosen set.

Under JAX's SPMD a step is one program over all the devices: its values are
global, there are no per-replica ones (as tf.distribute has).
"""

import re

import pandas as pd

from lab.backend.jax import compat

SPECS = ("cpu", "gpu", "tpu", "mirrored", "data_parallel")
_CHOSEN = re.compile(r"^(cpu|gpu|tpu):(\d+(,\d+)*)$")


def devices():
    """DataFrame of JAX's devices: `name`, `type` (CPU/GPU/TPU),
    `memory_bytes` where the device reports it, `description` (its kind,
    e.g. "TPU v5 lite").

    Example:

    ```python
    lab.devices()
    ```
    """
    import jax

    rows = []
    for device in _all_devices(jax):
        memory = None
        try:
            stats = device.memory_stats() or {}
            memory = stats.get("bytes_limit")
        except Exception:  # noqa: BLE001 - CPUs report no memory statistics
            pass
        rows.append({"name": f"{device.platform}:{device.id}", "type": device.platform.upper(),
                     "memory_bytes": float("nan") if memory is None else memory,
                     "description": getattr(device, "device_kind", "")})
    return pd.DataFrame(rows, columns=["name", "type", "memory_bytes", "description"])


def _all_devices(jax):
    found = list(jax.devices())
    if found and found[0].platform != "cpu":
        found += [d for d in jax.devices("cpu")]
    return found


def virtual_cpus(n):
    """Splits the host CPU into `n` JAX devices, so data-parallel code runs anywhere.

    Must run before JAX starts its backends (before the first array,
    model or `jax.devices()` call): put it first in the notebook.

    Args:
        n: int, 1 or more.

    Returns:
        int, the number of CPU devices JAX will have.

    Raises:
        RuntimeError: JAX already started with another number of CPU devices.

    Example:

    ```python
    import lab
    lab.virtual_cpus(2)
    lab.devices()   # cpu:0, cpu:1
    ```
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"lab.virtual_cpus(n) needs a whole number of devices, 1 or more; got {n!r} "
                         "(e.g. lab.virtual_cpus(2)).")
    import jax

    if compat.jax_started():
        have = len(jax.devices("cpu"))
        if have == n:
            return n
        raise RuntimeError(
            f"JAX has already started with {have} CPU device(s), and the number is fixed once it starts. "
            f"Call lab.virtual_cpus({n}) first thing in a new kernel (restart it), before anything makes "
            "an array or a model.")
    compat.set_cpu_device_count(n)
    return n


def strategy(spec):
    """The data parallelism `spec` names on JAX: a `keras.distribution.DataParallel`.

    Build the model under it (`with lab.strategy(spec).scope(): model = build()`,
    or `keras.distribution.set_distribution(...)` before building) and call
    `fit()` inside the same scope.

    Args:
        spec: str, "cpu", "gpu" or "tpu" (every device of that type),
            "cpu:0,1" / "gpu:0,1" (those devices), "mirrored" or
            "data_parallel" (every device of the default type).

    Returns:
        keras.distribution.DataParallel.

    Raises:
        ValueError: a spec this backend does not have (naming those it has),
            or a device that is not there.

    Example:

    ```python
    lab.virtual_cpus(2)
    with lab.strategy("cpu:0,1").scope():
        model = build_model()
    ```
    """
    import jax
    import keras

    if not isinstance(spec, str):
        raise TypeError(f"lab.strategy(spec) takes a str such as 'cpu', 'gpu:0,1' or 'mirrored'; got "
                        f"{type(spec).__name__}.")
    if spec == "multiworker":
        raise ValueError(
            "'multiworker' is tf.distribute's MultiWorkerMirroredStrategy; on Keras' JAX backend several "
            "processes need jax.distributed.initialize(), which the lab does not set up. Use one of "
            f"{', '.join(repr(s) for s in SPECS)} or 'cpu:0,1'.")
    chosen = _CHOSEN.match(spec)
    if chosen:
        kind, ids = chosen.group(1), [int(i) for i in chosen.group(2).split(",")]
        available = _of_type(jax, kind)
        by_id = {d.id: d for d in available}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"lab.strategy({spec!r}): no {kind.upper()} device {missing[0]}; this machine has "
                             f"{_listed(available, kind)}.")
        picked = [by_id[i] for i in ids]
    elif spec in ("cpu", "gpu", "tpu"):
        picked = _of_type(jax, spec)
        if not picked:
            raise ValueError(f"lab.strategy({spec!r}): this machine has no {spec.upper()} for JAX; it has "
                             f"{', '.join(sorted({d.platform for d in jax.devices()}))}.")
    elif spec in ("mirrored", "data_parallel"):
        picked = list(jax.devices())
    else:
        raise ValueError(f"Unknown strategy spec {spec!r}; on Keras' JAX backend use one of "
                         f"{', '.join(repr(s) for s in SPECS)}, or 'cpu:0,1' / 'gpu:0,1' for chosen devices.")
    return keras.distribution.DataParallel(devices=picked)


def _of_type(jax, kind):
    try:
        return list(jax.devices(kind))
    except RuntimeError:  # no backend of that kind
        return []


def _listed(available, kind):
    if not available:
        return f"no {kind.upper()}"
    return ", ".join(f"{kind}:{d.id}" for d in available)



def strategy_choices():
    """The specs `strategy()` can satisfy on this machine, most useful first.

    Returns:
        list of str.
    """
    import jax

    default = jax.devices()
    kind = default[0].platform
    choices = []
    if len(default) > 1:
        choices.append("mirrored")
    choices.append(kind)
    if kind != "cpu":
        choices.append("cpu")
    return choices


def describe(distribution):
    """One line saying what a distribution runs on, e.g.
    `"DataParallel: 2 devices (cpu:0, cpu:1)"`."""
    devices_ = list(getattr(distribution, "_devices", None) or distribution.device_mesh.devices.flatten())
    names = ", ".join(f"{d.platform}:{d.id}" for d in devices_)
    return f"{type(distribution).__name__}: {len(devices_)} device{'s' if len(devices_) != 1 else ''} ({names})"


def batch_split(distribution, global_batch_size):
    """How a data-parallel distribution splits one global batch: a DataFrame
    of `device`, `examples` (JAX shards a batch evenly over the mesh's batch
    axis).

    Raises:
        ValueError: the batch does not split evenly; names the multiple to use.
    """
    devices_ = list(distribution.device_mesh.devices.flatten())
    count = len(devices_)
    if int(global_batch_size) % count:
        raise ValueError(f"A global batch of {global_batch_size} does not split evenly over {count} devices: "
                         f"JAX shards each batch in equal parts. Use a multiple of {count}, e.g. "
                         f"{max(int(global_batch_size) // count, 1) * count}.")
    share = int(global_batch_size) // count
    return pd.DataFrame({"device": [f"{d.platform}:{d.id}" for d in devices_], "examples": [share] * count})


def uneven_first_batch(distribution, batch_size):
    """None where `fit()` can shard a batch of `batch_size`, else `(problem, fix)`."""
    count = len(list(distribution.device_mesh.devices.flatten()))
    if int(batch_size) % count == 0:
        return None
    lower = max(int(batch_size) // count, 1) * count
    return (f"a batch of {batch_size} does not split evenly over {count} devices",
            f"use batch_size={lower} (a multiple of {count})")
