"""The row schema: what each column of a run's batch table is, declared once.

The recorder, `watch`, the stepper, run files and the views read column
names, prefixes and kinds from here.

A value is either the batch's own (`BATCH`: its loss, a mean-type metric's
value on this batch alone, the learning rate the step used) or Keras'
running value since the epoch began (`RUNNING`: what a metric that is not a
mean reports, because its batch value cannot be read off its state). A run
lists its running columns in `run.metadata["running_values"]`, so a running
value is never shown as if it were the batch's.
"""

# Columns every batch row has.
STEP, EPOCH, BATCH_INDEX, SECONDS, MODE, SOURCE = "step", "epoch", "batch", "seconds", "mode", "source"
BASE_COLUMNS = (STEP, EPOCH, BATCH_INDEX, SECONDS, MODE)

LOSS = "loss"
GRAD_NORM = "grad_norm"  # global norm of the gradients applied in the step
UPDATED = "updated"  # 1 when an optimizer update went in, 0 when a breakpoint held it
LEARNING_RATE = "learning_rate"

# Per-variable and per-optimizer columns: prefix + "/" + key.
GRAD_NORM_PREFIX = "grad_norm/"  # norm of the variable's applied gradient (all applies in the step)
WEIGHT_NORM_PREFIX = "weight_norm/"
UPDATE_RATIO_PREFIX = "update_ratio/"
LEARNING_RATE_PREFIX = "learning_rate/"
UPDATED_PREFIX = "updated/"  # per optimizer, when several update
APPLIES_PREFIX = "applies/"  # per optimizer, when one applies more than once per step
REPLICA_LOSS_PREFIX = "loss/replica_"
REPLICA_GRAD_NORM_PREFIX = "grad_norm/replica_"

PER_VARIABLE_PREFIXES = (GRAD_NORM_PREFIX, WEIGHT_NORM_PREFIX, UPDATE_RATIO_PREFIX)

# A logged value that is a vector (F1Score(average=None): one value per
# class) is recorded as one column per element, `<name>/<index>`, up to this
# many elements; a longer or higher-rank value is not recorded.
MAX_VECTOR_ELEMENTS = 64


def element_column(name, index):
    """The column of element `index` of the vector logged as `name`."""
    return f"{name}/{index}"


def number_columns(name, value):
    """(column, float) pairs of a logged value: itself where it is a number,
    its elements where it is a vector of at most `MAX_VECTOR_ELEMENTS`
    numbers, else none."""
    import numpy as np

    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return []
    if array.ndim == 0:
        return [(name, float(array))]
    if array.ndim == 1 and 0 < array.size <= MAX_VECTOR_ELEMENTS:
        return [(element_column(name, i), float(v)) for i, v in enumerate(array)]
    return []


# Value kinds.
BATCH = "batch"
RUNNING = "running"
RUNNING_VALUES = "running_values"  # run.metadata key: columns holding running values
# run.metadata key: the per-variable norms (gradients, weights and updates)
# were taken at one step in this many, the others' norm columns left NaN
# (absent: every step).
NORMS_EVERY = "norms_every"
XLA_TRACED = "traced_in_xla"  # run.metadata key: XLA compiled the lab's reads with the step (probes.XLA_NOTE)
TOLD_PREFIX = "told_"  # run.metadata keys: variables named in a probe's trace-time warning, one a line
RECORD_ERRORS = "record_errors"  # run.metadata key: why steps could not be recorded, one message an item
# probes.TRACE_NOTES' kinds
TRACE_NOTE_KINDS = ("regrouped", "changed_after", "random", "update_step", "no_loss", "uncalled", "no_update",
                    "overwritten")

# The run.metadata keys the lab reads back (a continued run's recorder adds
# to them), and what each holds: a run file's metadata is checked against
# these when it is loaded. Other keys are free-form.
METADATA_TYPES = {RUNNING_VALUES: "names", RECORD_ERRORS: "names",
                  **{f"{TOLD_PREFIX}{kind}": "text" for kind in TRACE_NOTE_KINDS}}

# Columns starting with "_" are the probe's bookkeeping, never shown or saved.
INTERNAL = "_"


def is_internal(name):
    """Whether a column is the lab's bookkeeping rather than a value of the step."""
    return name.startswith(INTERNAL)


def learning_rate_column(optimizer_name, several):
    """The learning-rate column of one optimizer: `learning_rate` when one
    optimizer updates, `learning_rate/<attribute>` when several do."""
    return f"{LEARNING_RATE_PREFIX}{optimizer_name}" if several else LEARNING_RATE


def per_optimizer_column(prefix, optimizer_name):
    return f"{prefix}{optimizer_name}"


def variable_column(prefix, key):
    return f"{prefix}{key}"


def is_variable_column(name):
    """Whether `name` is a per-variable column (not a per-replica one)."""
    return name.startswith(PER_VARIABLE_PREFIXES) and not name.startswith(REPLICA_GRAD_NORM_PREFIX)


def value_kind(run, name):
    """`BATCH` or `RUNNING` for a column of `run`."""
    return RUNNING if name in run.metadata.get(RUNNING_VALUES, ()) else BATCH


def metadata_problem(metadata):
    """What in `metadata` (a run's) the lab could not read, as a sentence, or None.

    A key of `METADATA_TYPES` must hold what it says: a list of strings
    ("names") or a string ("text").
    """
    for key, holds in METADATA_TYPES.items():
        if key not in metadata:
            continue
        value = metadata[key]
        if holds == "names" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            wanted = "a list of strings"
        elif holds == "text" and not isinstance(value, str):
            wanted = "a string"
        else:
            continue
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return f"its metadata {key!r} is {shown}, not {wanted}"
    return None
