"""What a comparison of modes says, on any backend: which of the input and
the model bounds the run."""

import math


def bottleneck(frame, data_rate):
    """A one-line verdict: the input or the model, with their rates."""
    ok = frame[frame["error"].isna()]
    if ok.empty or math.isnan(data_rate):
        return "unknown: no mode ran"
    best = ok.loc[ok["steps_per_second"].idxmax()]
    where = f"{best['mode']} at steps_per_execution={best['steps_per_execution']}"
    if data_rate < best["steps_per_second"]:
        return (f"data: the input yields {data_rate:,.0f} batches/s, fewer than the "
                f"{best['steps_per_second']:,.0f} steps/s the model trains in {where}")
    return (f"model: the fastest mode ({where}) trains {best['steps_per_second']:,.0f} steps/s; "
            f"the input yields {data_rate:,.0f} batches/s")
