"""Devices and strategies: where training runs, chosen by a short name.

`devices()` lists what TensorFlow sees, `virtual_cpus(n)` splits the host CPU
so multi-replica code runs on any machine, and `strategy(spec)` turns a name
such as `"gpu"`, `"mirrored"` or `"tpu"` into a real `tf.distribute.Strategy`.

A process keeps one strategy per spec: creating a second `MirroredStrategy`
after eager work has broken collectives ("Shape mismatch in the collective
instance"), and TPU and multi-worker set-up may only happen once.
"""

import json
import logging
import os
import re
import threading

import numpy as np
import pandas as pd
import tensorflow as tf

# More logical CPUs than this only slow a strategy's set-up (10,000 took 110 s
# to build a MirroredStrategy) without showing anything a few do not.
MAX_VIRTUAL_CPUS = 64

SPECS = ("cpu", "cpu:N", "cpu:0,1", "gpu", "gpu:N", "gpu:0,1", "mirrored", "tpu", "multiworker")

_strategies = {}
_lock = threading.Lock()


def devices():
    """The logical devices TensorFlow sees, one row each.

    TPU cores appear once the TPU system is initialised (after
    `lab.strategy("tpu")`).

    Returns:
        pandas.DataFrame with columns `name` (e.g. `"/device:GPU:0"`), `type`
        (`"CPU"`, `"GPU"`, `"TPU"`), `memory_bytes` (the memory TensorFlow may
        use on a GPU; NaN where TensorFlow does not say) and `description`.

    Example:

    ```python
    lab.devices()[["name", "type"]]
    ```
    """
    logical = tf.config.list_logical_devices()
    details = _local_device_details() if any(d.device_type == "GPU" for d in logical) else {}
    rows = []
    for device in logical:
        name = _canonical(device.name)
        memory, description = details.get(name, (np.nan, ""))
        if device.device_type == "CPU":
            # TensorFlow reports a fixed allocator cap for CPUs, not the host's memory.
            memory = np.nan
        rows.append({"name": name, "type": device.device_type,
                     "memory_bytes": float(memory), "description": description})
    return pd.DataFrame(rows, columns=["name", "type", "memory_bytes", "description"])


def virtual_cpus(n):
    """Splits the host CPU into `n` logical devices, for multi-replica code anywhere.

    TensorFlow fixes its devices when it first uses them, so call this before
    any other TensorFlow work: first thing in the notebook or script. Asking
    for the number of logical CPUs already in force does nothing.

    Args:
        n: int, the number of logical CPUs, 1 to `MAX_VIRTUAL_CPUS` (64).

    Raises:
        ValueError: `n` is not an integer from 1 to 64.
        RuntimeError: TensorFlow already initialised its devices with a
            different split.

    Example:

    ```python
    import lab
    lab.virtual_cpus(2)            # before anything else touches TensorFlow
    strategy = lab.strategy("mirrored")
    ```
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"virtual_cpus(n) needs a positive integer n, got {n!r} (e.g. virtual_cpus(2)).")
    if n > MAX_VIRTUAL_CPUS:
        raise ValueError(
            f"virtual_cpus({n}) is more than the {MAX_VIRTUAL_CPUS} logical CPUs the lab allows: every "
            "logical CPU becomes a replica that a strategy builds, feeds and synchronises on the same "
            "cores, so thousands make a MirroredStrategy take minutes to build and teach nothing more "
            f"than a few do. Use 2 to {MAX_VIRTUAL_CPUS} (2 or 4 show everything multi-replica code does)."
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(int(n))]
        )
    except RuntimeError as error:
        found = len(tf.config.list_logical_devices("CPU"))
        if found == n:
            return  # already split this way, e.g. a notebook cell run twice
        raise RuntimeError(
            f"lab.virtual_cpus({n}) came too late: TensorFlow has already "
            f"initialised its devices ({found} logical CPU{'s' if found != 1 else ''}). "
            "Restart the kernel (or the Python process) and call "
            f"lab.virtual_cpus({n}) first, before any other TensorFlow or Keras work."
        ) from error


def strategy(spec):
    """A `tf.distribute.Strategy` for a short device spec, made once per process.

    Specs:

    - `"cpu"`, `"cpu:1"`, `"gpu"`, `"gpu:1"`: one device (`OneDeviceStrategy`).
    - `"gpu:0,1"`, `"cpu:0,1"`: those devices mirrored (`MirroredStrategy`).
    - `"mirrored"`: all local GPUs, or all logical CPUs where there is no GPU
      (see `virtual_cpus`).
    - `"tpu"`: the TPU of a TPU VM (Colab, Kaggle): `TPUClusterResolver(tpu="local")`,
      `initialize_tpu_system`, `TPUStrategy`.
    - `"multiworker"`: `MultiWorkerMirroredStrategy` configured from the
      `TF_CONFIG` environment variable (one worker when it is unset). Make it
      before any other TensorFlow work in the process.

    Asking twice for the same spec (or for two specs naming the same devices)
    returns the same object. A `tf.distribute.Strategy` passed in is returned
    as it is.

    Args:
        spec: str or tf.distribute.Strategy.

    Returns:
        tf.distribute.Strategy. Build and compile the model under its scope.

    Raises:
        ValueError: the spec is malformed, or names a device that is not here
            (the message lists the devices found).
        RuntimeError: the TPU or the multi-worker cluster could not be set up
            (the message carries TensorFlow's own error).

    Example:

    ```python
    strategy = lab.strategy("mirrored")
    with strategy.scope():
        model = build_model()      # create and compile under the scope
    model.fit(x, y, callbacks=[lab.Recorder(gradients=True)])
    ```
    """
    if isinstance(spec, tf.distribute.Strategy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"A strategy spec is a string such as 'gpu' or 'mirrored', got {spec!r}.")
    kind, devices_ = _parse(spec)
    key = (kind, devices_)
    with _lock:
        made = _strategies.get(key)
        if made is None:
            made = _make(kind, devices_)
            _strategies[key] = made
        return made


def strategy_choices():
    """The specs `strategy()` can satisfy on this machine, most useful first.

    `"tpu"` and `"multiworker"` are listed only where they can work: a TPU
    system already initialised or a TPU runtime detected, and `TF_CONFIG` set.

    Returns:
        list of str.
    """
    cpus = _names("CPU")
    gpus = _names("GPU")
    choices = []
    if _tpu_runtime():
        choices.append("tpu")
    if len(gpus) > 1:
        choices.append("mirrored")
    choices += ["gpu"] if gpus else []
    choices += [f"gpu:{i}" for i in range(1, len(gpus))]
    if not gpus and len(cpus) > 1:
        choices.append("mirrored")
    choices.append("cpu")
    choices += [f"cpu:{i}" for i in range(1, len(cpus))]
    if os.environ.get("TF_CONFIG"):
        choices.append("multiworker")
    return choices


def describe(strategy_):
    """One line saying what a strategy runs on, for status lines and notebooks.

    Args:
        strategy_: tf.distribute.Strategy.

    Returns:
        str, e.g. `"MirroredStrategy: 2 replicas on CPU:0, CPU:1"`.
    """
    extended = strategy_.extended
    names = getattr(extended, "worker_devices", None) or ()
    devices_ = ", ".join(_short(d) for d in names) or "the default device"
    replicas = strategy_.num_replicas_in_sync
    return (f"{type(strategy_).__name__}: {replicas} replica{'s' if replicas != 1 else ''} "
            f"on {devices_}")


def batch_split(strategy_, global_batch_size):
    """How a strategy splits one global batch among its replicas.

    tf.distribute gives each replica in turn `ceil(global_batch_size /
    replicas)` examples until the batch runs out: 16 on 3 replicas is 6, 6
    and 4, and a last batch of 1 is 1, 0 and 0. The loss of each replica is
    divided by the global batch size, so the summed gradients equal those of
    one device on the whole batch. Under a MirroredStrategy, `fit()` fails
    before it trains where its first batch is split unevenly
    (`uneven_first_batch`): keep the global batch a multiple of the replicas.

    Args:
        strategy_: tf.distribute.Strategy.
        global_batch_size: int, the `batch_size` given to `fit()`.

    Returns:
        pandas.DataFrame with columns `replica`, `device` and `examples`.

    Example:

    ```python
    from lab.backend.tensorflow.devices import batch_split
    batch_split(lab.strategy("mirrored"), 33)   # 17 and 16 examples
    ```
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)) \
            or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    replicas = strategy_.num_replicas_in_sync
    local = list(getattr(strategy_.extended, "worker_devices", ()) or ())
    names = [_short(d) for d in local] if len(local) == replicas else [f"replica {i}" for i in range(replicas)]
    each = -(-int(global_batch_size) // replicas)
    return pd.DataFrame({
        "replica": range(replicas),
        "device": names,
        "examples": [min(each, max(0, int(global_batch_size) - i * each)) for i in range(replicas)],
    })


UNEVEN_FIRST_BATCH = (
    "A first batch of {batch} examples on {replicas} replicas is split unevenly ({parts}), and fit() "
    "fails on it before it trains (Keras builds the model from the replicas' first shares averaged "
    "together, which needs them the same size: 'Inputs to operation AddN of type AddN must have the same "
    "size and shape')")
UNEVEN_FIRST_BATCH_FIX = "use a global batch size that is a multiple of {replicas}: {lower} or {higher}."


def uneven_first_batch(strategy_, batch_size):
    """What fit() does with a first batch of `batch_size` examples that the
    replicas of `strategy_` cannot share evenly: None where it trains, else
    `(problem, fix)`. Keras' TensorFlow trainer (3.5 to 3.15) averages the
    replicas' shares of the first batch to build the model symbolically,
    and fails where they differ in size; a last, partial batch split
    unevenly trains."""
    replicas = strategy_.num_replicas_in_sync
    if not splits_batches(strategy_) or int(batch_size) % replicas == 0:
        return None
    split = batch_split(strategy_, int(batch_size))
    parts = ", ".join(f"{row.examples} on {row.device}" for row in split.itertuples())
    lower = max(int(batch_size) // replicas, 1) * replicas
    return (UNEVEN_FIRST_BATCH.format(batch=int(batch_size), replicas=replicas, parts=parts),
            UNEVEN_FIRST_BATCH_FIX.format(replicas=replicas, lower=lower, higher=lower + replicas))


def splits_batches(strategy_):
    """Whether `fit()` and `predict()` split each batch over the replicas of
    `strategy_` in this process, as the lab can too: a MirroredStrategy with
    several replicas (TPUs and several workers are not split here)."""
    return strategy_.num_replicas_in_sync > 1 and isinstance(strategy_, tf.distribute.MirroredStrategy)


def split_over_replicas(strategy_, batch, spec=None):
    """One batch split over the replicas as `fit()` and `predict()` split
    theirs: tf.distribute's rebatch of a dataset holding the batch (each
    replica in turn `ceil(batch / replicas)` examples, `batch_split`).

    Args:
        strategy_: tf.distribute.Strategy.
        batch: a structure of tensors, the whole batch.
        spec: the structure's `tf.TensorSpec`s as the caller's dataset
            declares them (a batch size left open), or None for the
            batch's own shapes.

    Returns:
        (the batch as per-replica values for `strategy_.run`, their spec).
    """
    specs = tf.nest.flatten(spec) if spec is not None else []
    if specs and all(isinstance(leaf, tf.TensorSpec) for leaf in specs):
        dataset = tf.data.Dataset.from_generator(lambda: iter([batch]), output_signature=spec)
    else:
        dataset = tf.data.Dataset.from_tensors(batch)
    distributed = strategy_.experimental_distribute_dataset(dataset)
    return next(iter(distributed)), distributed.element_spec


# ---- parsing and making --------------------------------------------------

_SPEC = re.compile(r"^(cpu|gpu)(?::(\d+(?:,\d+)*))?$")


def _parse(spec):
    text = spec.strip().lower().replace(" ", "")
    if text in ("mirrored", "tpu", "multiworker"):
        return _resolve_named(text)
    match = _SPEC.match(text)
    if match is None:
        raise ValueError(
            f"Unknown strategy spec {spec!r}. Use one of: " + ", ".join(repr(s) for s in SPECS) + "."
        )
    device_type = match.group(1).upper()
    indices = [int(i) for i in match.group(2).split(",")] if match.group(2) else [0]
    if len(set(indices)) != len(indices):
        raise ValueError(f"Strategy spec {spec!r} names a device twice.")
    available = _names(device_type)
    missing = [i for i in indices if i >= len(available)]
    if missing:
        raise ValueError(_missing_message(spec, device_type, missing))
    # In the order TensorFlow lists them, as "mirrored" takes them: the same
    # devices named in another order are the same strategy.
    chosen = tuple(available[i] for i in sorted(indices))
    return ("one" if len(chosen) == 1 else "mirrored"), chosen


def _resolve_named(name):
    if name == "tpu":
        return "tpu", ()
    if name == "multiworker":
        return "multiworker", ()
    gpus = _names("GPU")
    if gpus:
        return "mirrored", tuple(gpus)
    cpus = _names("CPU")
    if len(cpus) < 2:
        raise ValueError(
            "'mirrored' needs several devices, and TensorFlow sees only "
            f"{_found()}. Without a GPU, split the CPU: call lab.virtual_cpus(2) "
            "first thing in a fresh kernel, before any other TensorFlow work."
        )
    return "mirrored", tuple(cpus)


def _make(kind, devices_):
    # TensorFlow logs each strategy it makes at INFO, into the cell's output
    # where a kernel's logger passes INFO; describe() says it once, the same way.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        if kind == "one":
            return tf.distribute.OneDeviceStrategy(devices_[0])
        if kind == "mirrored":
            return tf.distribute.MirroredStrategy(list(devices_))
        if kind == "tpu":
            return _make_tpu()
        return _make_multiworker()
    finally:
        logger.setLevel(level)


def _make_tpu():
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local")
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    except Exception as error:  # noqa: BLE001 - re-raised with the fix, cause kept
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise RuntimeError(
            f"No TPU could be initialised here (TensorFlow sees {_found()}). "
            "'tpu' works on a TPU VM with TensorFlow's TPU support installed, "
            "e.g. Colab (Runtime > Change runtime type > a TPU) or Kaggle. "
            f"TensorFlow said: {type(error).__name__}: {first_line}"
        ) from error


def _make_multiworker():
    config = os.environ.get("TF_CONFIG")
    if config:
        _check_tf_config(config)
    try:
        return tf.distribute.MultiWorkerMirroredStrategy()
    except RuntimeError as error:
        raise RuntimeError(
            "lab.strategy('multiworker') came too late: a multi-worker strategy must "
            "be made before any other TensorFlow work in the process. Call it first "
            f"(TensorFlow said: {error})."
        ) from error


def _check_tf_config(text):
    try:
        config = json.loads(text)
        workers = config["cluster"]["worker"]
        task = config["task"]
        index = int(task["index"])
        task_type = task["type"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            "TF_CONFIG is not a multi-worker configuration. It should look like "
            '{"cluster": {"worker": ["host1:port", "host2:port"]}, '
            f'"task": {{"type": "worker", "index": 0}}}}; got {text!r} ({error}).'
        ) from error
    if task_type == "worker" and not 0 <= index < len(workers):
        raise ValueError(
            f"TF_CONFIG's task index {index} is outside its {len(workers)} workers."
        )


# ---- what is here ---------------------------------------------------------

def _names(device_type):
    return [_canonical(d.name) for d in tf.config.list_logical_devices(device_type)]


def _found():
    listed = tf.config.list_logical_devices()
    return ", ".join(_short(d.name) for d in listed) or "no devices"


def _missing_message(spec, device_type, missing):
    word = "device" if len(missing) == 1 else "devices"
    shown = ", ".join(f"{device_type}:{i}" for i in missing)
    hint = ""
    if device_type == "GPU":
        hint = " Use 'cpu', or run on a machine with a GPU (Colab: Runtime > Change runtime type)."
    elif device_type == "CPU":
        hint = " For more CPUs, call lab.virtual_cpus(n) first thing in a fresh kernel."
    return f"Strategy spec {spec!r} asks for {word} {shown}, but TensorFlow sees {_found()}.{hint}"


def _tpu_runtime():
    if tf.config.list_logical_devices("TPU"):
        return True
    # TPU VMs expose their chips as /dev/accel* (v2-v4) or /dev/vfio (v5e and later).
    return any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0")) or bool(
        os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR")
    )


def _canonical(name):
    # Multi-worker and TPU names carry a job prefix; keep what a user reads.
    match = re.search(r"device:([A-Z_]+):(\d+)$", name)
    return f"/device:{match.group(1)}:{match.group(2)}" if match else name


def _short(name):
    match = re.search(r"(?:device:)?([A-Za-z_]+):(\d+)$", name)
    return f"{match.group(1).upper()}:{match.group(2)}" if match else name


def _local_device_details():
    """Memory and description per device name, from TensorFlow's device list."""
    try:
        from tensorflow.python.client import device_lib

        listed = device_lib.list_local_devices()
    except Exception:  # noqa: BLE001 - the listing is a nicety; names still come
        return {}
    details = {}
    for device in listed:
        description = device.physical_device_desc or ""
        match = re.search(r"name: ([^,]+)", description)
        details[_canonical(device.name)] = (
            float(device.memory_limit) if device.memory_limit else np.nan,
            match.group(1) if match else "",
        )
    return details
