"""DevicePicker: choose where training runs and build the model there.

Keras creates a model's variables on the strategy in force when the model is
built, so a strategy cannot be applied to a finished model: the picker takes
a factory, `build_model()`, and calls it under the chosen strategy's scope.
"""

import html

import ipywidgets
import keras

import lab
from lab.backend import device_support

batch_split, describe, strategy_choices, uneven_first_batch = (
    device_support.batch_split, device_support.describe, device_support.strategy_choices,
    device_support.uneven_first_batch)


class DevicePicker(ipywidgets.VBox):
    """Lists the devices, picks a strategy and builds the model under its scope.

    Args:
        build_model: callable taking no arguments and returning a compiled
            `keras.Model`; it is called inside `strategy.scope()`.
        choices: sequence of str or None, the strategy specs offered (see
            `lab.strategy`); by default those this machine can satisfy.
        value: str or None, the spec selected at first.
        batch_size: int or None, a global batch size whose split among the
            replicas is shown after each build.

    Attributes:
        model: the last model built, or None.
        strategy: the strategy it was built under, or None.

    Example:

    ```python
    picker = widgets.DevicePicker(make_model, batch_size=64)
    picker                         # choose, then click Build
    picker.build("mirrored")       # or build from code
    picker.model.fit(x, y, batch_size=64, callbacks=[widgets.Dashboard()])
    ```
    """

    def __init__(self, build_model, choices=None, value=None, batch_size=None):
        if isinstance(build_model, keras.Model) or not callable(build_model):
            raise TypeError(
                "DevicePicker needs a function that builds and compiles the model "
                f"(e.g. `def build_model(): ...`), got {type(build_model).__name__}. "
                "Keras places variables when the model is built, so pass the factory, not a model."
            )
        self.build_model = build_model
        self.batch_size = batch_size
        self.model = None
        self.strategy = None
        self._listeners = []
        options = list(choices) if choices is not None else strategy_choices()
        self.devices_table = ipywidgets.HTML(_devices_html(lab.devices()))
        self.dropdown = ipywidgets.Dropdown(
            options=options, value=value if value is not None else options[0],
            description="strategy", layout={"width": "220px"},
        )
        self.build_button = ipywidgets.Button(description="Build", icon="play",
                                              tooltip="Build the model under this strategy")
        self.status = ipywidgets.HTML()
        self.build_button.on_click(self._on_click)
        super().__init__([self.devices_table, ipywidgets.HBox([self.dropdown, self.build_button]),
                          self.status])

    def build(self, spec=None):
        """Builds the model under the strategy for `spec` (default: the selected one).

        Args:
            spec: str or None, a `lab.strategy` spec; it becomes the selection.

        Returns:
            keras.Model, also kept as `picker.model`.

        Raises:
            ValueError, RuntimeError: the spec cannot be satisfied here (the
                message, also shown in the panel, names what was found).
        """
        spec = self.dropdown.value if spec is None else spec
        if spec not in self.dropdown.options:
            self.dropdown.options = (*self.dropdown.options, spec)
        self.dropdown.value = spec
        try:
            strategy = lab.strategy(spec)
            with strategy.scope():
                model = self.build_model()
        except Exception as error:
            self._say(f"{type(error).__name__}: {error}", error=True)
            raise
        self.strategy, self.model = strategy, model
        self._say(self._summary(spec))
        for listener in list(self._listeners):
            listener(model, strategy)
        return model

    def on_build(self, fn):
        """Calls `fn(model, strategy)` after each successful build (to hand the model on)."""
        self._listeners.append(fn)

    def _on_click(self, _button):
        try:
            self.build()
        except Exception:  # noqa: BLE001 - already shown in the panel; a click has no caller
            pass

    def _summary(self, spec):
        text = (f"Built {html.escape(self.model.name)} for '{html.escape(spec)}': "
                f"{html.escape(describe(self.strategy))}.")
        if self.batch_size:
            try:
                split = batch_split(self.strategy, self.batch_size)
            except ValueError as error:
                return text + f"<br>{html.escape(str(error))}"
            parts = ", ".join(f"{row.examples} on {row.device}" for row in split.itertuples())
            text += f"<br>A global batch of {self.batch_size} is split: {html.escape(parts)}."
            uneven = uneven_first_batch(self.strategy, self.batch_size)
            if uneven is not None:
                text += f"<br><span style='color:#b00020'>{html.escape(uneven[0])}: {html.escape(uneven[1])}</span>"
        return text

    def _say(self, text, error=False):
        if error:
            text = f"<span style='color:#b00020'>{html.escape(text)}</span>"
        self.status.value = text


def _devices_html(frame):
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(r.type)}</td>"
        f"<td>{_memory(r.memory_bytes)}</td><td>{html.escape(r.description or '')}</td></tr>"
        for r in frame.itertuples()
    )
    return ("<table><tr><th>device</th><th>type</th><th>memory</th><th></th></tr>"
            f"{rows}</table>")


def _memory(value):
    return "" if value != value else f"{value / 2**30:.1f} GiB"
