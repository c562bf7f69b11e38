"""How Keras names the metrics a step logs, and which of them are means.

Backend-neutral: read from the Keras objects alone. A mean metric's batch
value can be read off its state (the change of its total over the change
of its count); another metric's logged value is its running value.
"""

import functools

import keras


def leaf_metrics(model):
    """Maps the names Keras logs under to metric objects (compiled metrics flattened)."""
    names = {}
    for metric in model.metrics:
        flat = getattr(metric, "_flat_metrics", None)
        if flat is None:
            names.setdefault(metric.name, metric)
            continue
        for name, leaf in _compiled_metric_names(flat, getattr(metric, "_flat_weighted_metrics", None) or []).items():
            names.setdefault(name, leaf)
    return names


def _compiled_metric_names(flat, weighted):
    """The names compiled metrics are logged under, each to its metric: as
    `CompileMetrics.result()` names them (Keras 3.5 to 3.15 alike), a
    repeated name numbered (`xent_1`) and a weighted metric whose name is
    taken prefixed (`weighted_accuracy`)."""
    names, counters = {}, {}

    def prefixed(group, name):
        return f"{group.output_name}_{name}" if group.output_name else name

    for group in flat:
        for leaf in (group.metrics if group else []):
            name = prefixed(group, leaf.name)
            if name in counters:
                counters[name] += 1
                name = f"{name}_{counters[name] - 1}"
            else:
                counters[name] = 1
            names[name] = leaf
    for group in weighted:
        for leaf in (group.metrics if group else []):
            name = prefixed(group, leaf.name)
            if name in counters:
                name = prefixed(group, f"weighted_{leaf.name}")
                if name in counters:
                    counters[name] += 1
                    name = f"{name}_{counters[name] - 1}"
                else:
                    counters[name] = 1
            else:
                counters[name] = 1
            names[name] = leaf
    return names


def is_mean(metric):
    """Whether a metric is a mean (`total / count`): its batch value can be
    read off its state. Not a Mean whose class computes its result otherwise
    (RootMeanSquaredError takes the root of its mean): its batch value would
    be the mean of its state, not its result on the batch."""
    return (isinstance(metric, keras.metrics.Mean) and hasattr(metric, "total") and hasattr(metric, "count")
            and _results_as_mean(type(metric)))


@functools.lru_cache(maxsize=None)
def _results_as_mean(cls):
    """Whether class `cls` takes its result from Mean (`total / count`)."""
    return next(klass for klass in cls.__mro__ if "result" in vars(klass)) is keras.metrics.Mean


def mean_parts(metric):
    """A mean metric's (total, count) variables, or None for another metric."""
    if not is_mean(metric):
        return None
    return metric.total, metric.count
