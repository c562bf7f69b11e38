"""Showing a view: a widget plus a static rendering, updatable by display id."""


def view_bundle(model_id, text, html, include=None, exclude=None):
    """The output bundle of a view: the widget, a text summary and static HTML.

    Built here rather than by a container's own `_repr_mimebundle_`, whose
    text/plain is the repr of every child (plotly figures and their random
    uids included): slow, and replaced anyway.
    """
    bundle = {
        "application/vnd.jupyter.widget-view+json": {
            "version_major": 2, "version_minor": 0, "model_id": model_id},
        "text/plain": text,
        "text/html": html,
    }
    return {k: v for k, v in bundle.items()
            if (include is None or k in include) and (exclude is None or k not in exclude)}


def show(view, handles):
    """Displays `view` with a display id and keeps the handle in `handles`, so
    the output can be updated when training ends (the static charts then show
    the final run where no widget frontend exists)."""
    from IPython.display import display

    handle = display(view._repr_mimebundle_(), raw=True, display_id=True)
    if handle is not None:
        handles.append(handle)
