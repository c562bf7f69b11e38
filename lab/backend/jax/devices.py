"""Devices on JAX: what `jax.devices()` lists, as a table."""

import pandas as pd


def devices():
    """DataFrame of JAX's devices: `name`, `type` (CPU/GPU/TPU), `kind`,
    `memory_bytes` where the device reports it.

    Example:

    ```python
    lab.devices()
    ```
    """
    import jax

    rows = []
    for device in jax.devices():
        memory = None
        try:
            stats = device.memory_stats() or {}
            memory = stats.get("bytes_limit")
        except Exception:  # noqa: BLE001 - CPUs report no memory statistics
            pass
        rows.append({"name": f"{device.platform}:{device.id}", "type": device.platform.upper(),
                     "kind": getattr(device, "device_kind", ""), "memory_bytes": memory})
    return pd.DataFrame(rows, columns=["name", "type", "kind", "memory_bytes"])
