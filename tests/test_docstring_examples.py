"""Every ```python example in the docstrings of `lab` and `widgets` runs as written.

The examples are collected from the objects of both packages: what their
`__all__` exports, and every function, class, method and property defined in
their submodules (plus the module docstrings). Each runs in a namespace of its
own, the way doctest runs one: its module's globals, so an example may call its
module's own functions by name, plus the names the examples share (`model`,
`x`, `y`, `rec`, `stepper`, `dash`, ...). A shared name is built only when the
example reads it, fresh for each example where the example changes it (a
model, a stepper, a Dashboard); finished runs are read-only and made once.

An example that reads a name nothing here provides fails, naming it: give the
name to `SHARED` below, or fix the example. Examples that need two logical CPUs
(`lab.virtual_cpus(2)` must run before TensorFlow initialises its devices) run
together in one fresh Python process.

Files the examples read (`run.h5`, `best.weights.h5`, ...) are written into
the example's own working directory before it runs. Examples that display run
headless: widgets build without a front end, and `IPython.display.display`
outside a kernel prints the object and returns None (no display handle).
"""

import builtins
import importlib
import inspect
import json
import os
import pathlib
import pkgutil
import re
import subprocess
import symtable
import sys
import textwrap
import threading

import pytest

PACKAGES = ("lab", "widgets")
ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)

FEATURES = 16  # flat 4x4 "images", so widgets.image_grid can draw x_test
CLASSES = 3
SAMPLES = 256

# Examples that need two logical CPUs: they run in one fresh process that calls
# lab.virtual_cpus(2) first (this one has initialised TensorFlow already).
NEEDS_TWO_CPUS = {
    "lab.backend.tensorflow.devices.virtual_cpus",
    "lab.backend.tensorflow.devices.strategy",
    "lab.backend.tensorflow.devices.batch_split",
    "widgets.device_picker.DevicePicker",
}

# Examples that cannot run here, with the reason (reported as skipped).
CANNOT_RUN = {}


# ---- collecting the examples ------------------------------------------------------


def _other_backend(module_name):
    """Whether a module is in a backend part of the lab Keras does not run on (`lab/backend/jax/` here on
    TensorFlow): such a part imports its own framework, which may not be installed."""
    import lab.backend

    parts = module_name.split(".")
    return (len(parts) > 2 and parts[:2] == ["lab", "backend"] and parts[2] != lab.backend.NAME
            and (ROOT / "lab" / "backend" / parts[2]).is_dir())


def _modules():
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        yield package
        for info in pkgutil.walk_packages(package.__path__, package_name + ".", onerror=lambda name: None):
            if not _other_backend(info.name):
                yield importlib.import_module(info.name)


def _own_doc(obj):
    # obj.__doc__ of the object itself: inspect.getdoc would hand a class or a
    # method without a docstring the one it inherits (from Keras, say).
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _members(cls):
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if inspect.isfunction(value) and value.__qualname__.startswith(cls.__qualname__ + "."):
            yield value


def _documented_objects():
    """(qualified name, object, its module) for every object defined in lab and widgets."""
    seen = set()

    def visit(obj, module):
        key = module.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"
        if key in seen:
            return
        seen.add(key)
        yield key, obj, module
        if inspect.isclass(obj):
            for member in _members(obj):
                yield from visit(member, module)

    for package_name in PACKAGES:  # what the packages export, first
        package = importlib.import_module(package_name)
        for name in package.__all__:
            obj = getattr(package, name)
            if inspect.ismodule(obj) or obj.__module__.split(".")[0] not in PACKAGES:
                continue  # submodules are walked below; a re-exported Keras name is not ours
            yield from visit(obj, sys.modules[obj.__module__])
    for module in _modules():
        yield from visit(module, module)
        for value in list(vars(module).values()):
            if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__:
                yield from visit(value, module)


def collect_examples():
    """{example id: (source, module name)}, one entry per ```python block."""
    examples = {}
    for key, obj, module in _documented_objects():
        blocks = EXAMPLE_BLOCK.findall(_own_doc(obj))
        for i, block in enumerate(blocks):
            examples[key if i == 0 else f"{key}#{i + 1}"] = (textwrap.dedent(block), module.__name__)
    return examples


EXAMPLES = collect_examples()


# ---- the shared names ---------------------------------------------------------------


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    weights = rng.normal(size=(FEATURES, CLASSES))

    def split(n):
        x = rng.random((n, FEATURES)).astype("float32")
        return x, ((x - 0.5) @ weights).argmax(-1).astype("int32")

    return split(SAMPLES), split(64)


(_X, _Y), (_X_VAL, _Y_VAL) = _data()


def new_model(seed=0, learning_rate=1e-3):
    """The examples' `model`: a compiled MLP, 16 features -> 3 classes.

    Functional, with its layers named, so variable paths read `dense/kernel`.
    """
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu", name="dense")(inputs)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="out")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def new_vae():
    """The examples' `vae`: encoder, decoder and a custom train_step, as a VAE has (no sampling)."""
    import keras
    import tensorflow as tf

    class Autoencoder(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)], name="encoder")
            self.decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(FEATURES)], name="decoder")

        def call(self, x):
            return self.decoder(self.encoder(x))

        def train_step(self, data):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(x - self(x, training=True)))
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            return {"loss": loss}

    keras.utils.set_random_seed(0)
    vae = Autoencoder()
    vae(_X[:1])
    vae.compile(optimizer=keras.optimizers.Adam(1e-3))
    return vae


_RECORDED = {}


def recorded(learning_rate):
    """A lab.Recorder that recorded two epochs of a model (made once; examples only read its run)."""
    if learning_rate not in _RECORDED:
        import lab

        recorder = lab.Recorder(gradients=True)
        recorder.run.name = f"lr={learning_rate}"
        new_model(learning_rate=learning_rate).fit(_X, _Y, epochs=2, batch_size=32, validation_data=(_X_VAL, _Y_VAL),
                                                   callbacks=[recorder], verbose=0)
        _RECORDED[learning_rate] = recorder
    return _RECORDED[learning_rate]


def _train_step(get):
    import tensorflow as tf

    model, optimizer, loss_fn = get("model"), get("optimizer"), get("loss_fn")

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return train_step


def _my_wrapper(get):
    def my_wrapper(inner):
        def compute_loss(*args, **kwargs):
            return inner(*args, **kwargs)

        return compute_loss

    return my_wrapper


def _batches(get):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((get("x"), get("y"))).batch(32)


def _module(name):
    return lambda get: importlib.import_module(name)


def _ipython(get):
    import IPython.display  # noqa: F401  (makes IPython.display an attribute)

    return sys.modules["IPython"]


def _long_loss(get):
    import numpy as np

    steps = np.arange(100_000)
    return 2.0 * np.exp(-steps / 20_000) + 0.05 * np.random.default_rng(0).random(steps.size)


def _controls(get):
    import ipywidgets

    return ipywidgets.HBox([ipywidgets.Button(description="Pause"), ipywidgets.Button(description="Stop")])


# name -> factory(get): `get(other)` gives this example's value of another shared name.
SHARED = {
    "np": _module("numpy"),
    "tf": _module("tensorflow"),
    "keras": _module("keras"),
    "lab": _module("lab"),
    "widgets": _module("widgets"),
    "ipywidgets": _module("ipywidgets"),
    "IPython": _ipython,
    "x": lambda get: _X,
    "y": lambda get: _Y,
    "x_val": lambda get: _X_VAL,
    "y_val": lambda get: _Y_VAL,
    "x_train": lambda get: _X,
    "y_train": lambda get: _Y,
    "x_test": lambda get: _X_VAL,
    "y_test": lambda get: _Y_VAL,
    "x_big": lambda get: get("np").random.default_rng(1).random((3000, FEATURES), "float32"),
    "data": _batches,
    "dataset": _batches,
    "loss": _long_loss,
    "model": lambda get: new_model(),
    "vae": lambda get: new_vae(),
    "build_model": lambda get: new_model,
    "make_model": lambda get: new_model,
    "opt": lambda get: get("keras").optimizers.Adam(1e-3),
    "optimizer": lambda get: get("opt"),
    "loss_fn": lambda get: get("keras").losses.SparseCategoricalCrossentropy(),
    "train_step": _train_step,
    "recorder": lambda get: recorded(0.01),
    "rec": lambda get: recorded(0.01),  # like every recorded run here: for reading only
    "slow": lambda get: recorded(0.01),
    "fast": lambda get: recorded(0.1),
    "run": lambda get: recorded(0.01).run,
    "runs": lambda get: {"lr=0.1": recorded(0.1).run, "lr=0.01": recorded(0.01).run},
    "stepper": lambda get: get("lab").Stepper(get("model"), (get("x"), get("y")), batch_size=32, seed=0),
    "dash": lambda get: get("widgets").Dashboard(),
    "dashboard": lambda get: get("widgets").Dashboard(),
    "state": lambda get: importlib.import_module("widgets.series").ChartState(get("run")),
    "controls": _controls,
    "owner": lambda get: object(),
    "my_wrapper": _my_wrapper,
}

# Files the examples read, written into their working directory when the example names them.
FILES = {
    "run.h5": lambda get: recorded(0.01).run.save("run.h5"),
    "runs/lr-0.01.h5": lambda get: recorded(0.01).run.save("runs/lr-0.01.h5"),
    # Saved after training, as a checkpoint is: with the optimizer's state.
    "best.weights.h5": lambda get: recorded(0.01).model.save_weights("best.weights.h5"),
}


def _names(source):
    """(names the example's code reads from its globals, names its top level binds)."""
    top = symtable.symtable(source, "<example>", "exec")
    read, bound = set(), set()

    def visit(table):
        for symbol in table.get_symbols():
            if table is top:
                if symbol.is_assigned() or symbol.is_imported():
                    bound.add(symbol.get_name())
                if symbol.is_referenced():
                    read.add(symbol.get_name())
            elif symbol.is_global() and symbol.is_referenced():  # a function's or lambda's free name
                read.add(symbol.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return read, bound


def namespace(source, module_name):
    """The globals an example runs in: its module's, then the shared names it reads."""
    read, bound = _names(source)
    module_globals = vars(importlib.import_module(module_name))
    shared = {}

    def get(name):
        if name not in shared:
            shared[name] = SHARED[name](get)
        return shared[name]

    # A name the example binds itself is its own (`rec = lab.Recorder()`), even if shared has one.
    wanted = sorted(read - bound)
    missing = [n for n in wanted if n not in SHARED and n not in module_globals and not hasattr(builtins, n)]
    if missing:
        pytest.fail(f"The example reads {missing}, which nothing provides: fix the example, or add the "
                    f"name to SHARED in {pathlib.Path(__file__).name}.\n{source}", pytrace=False)
    for name in wanted:
        if name in SHARED:
            get(name)
    for path, write in FILES.items():
        if f'"{path}"' in source or f"'{path}'" in source:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            write(get)
    return {**module_globals, "__name__": "__example__", **shared}


def run_example(example_id):
    """Runs one example in the current working directory; joins what it left training."""
    source, module_name = EXAMPLES[example_id]
    background = importlib.import_module("widgets.background").BackgroundFit
    started, start = [], background.start

    def recording_start(self):
        started.append(self)
        return start(self)

    background.start = recording_start
    ns = {}
    try:
        ns = namespace(source, module_name)
        exec(compile(source, f"<example {example_id}>", "exec"), ns)  # noqa: S102 (running it is the test)
    finally:
        background.start = start
        # An example may leave fit() running on a thread (a notebook would go on); let it end here.
        for training in started:
            assert training.join(timeout=120), f"{example_id}: its BackgroundFit was still training after 120 s"
        for value in list(ns.values()):
            if isinstance(value, threading.Thread) and value.is_alive():
                value.join(timeout=120)
    for training in started:
        assert training.error is None, f"{example_id}: fit() on its BackgroundFit failed: {training.error!r}"


# ---- the tests ------------------------------------------------------------------------


def _base(example_id):
    return example_id.split("#")[0]


TWO_CPU_IDS = [i for i in EXAMPLES if _base(i) in NEEDS_TWO_CPUS]

_TWO_CPU_SCRIPT = """
import json, os, runpy, sys, traceback
import lab
lab.virtual_cpus(2)
tests = runpy.run_path(sys.argv[1])
results = {}
for example_id in sys.argv[3:]:
    os.makedirs(example_id); os.chdir(example_id)
    try:
        tests["run_example"](example_id)
        results[example_id] = None
    except BaseException:
        results[example_id] = traceback.format_exc()
    os.chdir("..")
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


class TwoCpuProcess:
    """The NEEDS_TWO_CPUS examples, run in one fresh process while the others run here."""

    def __init__(self, folder, ids):
        self.folder = folder
        self.out = folder / "results.json"
        self.log = open(folder / "output.txt", "w+")  # noqa: SIM115 (the process writes it until close())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _TWO_CPU_SCRIPT, __file__, str(self.out), *ids],
            cwd=folder, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._results = None

    def error(self, example_id):
        """The example's traceback, or None when it ran."""
        if self._results is None:
            try:
                self.process.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if not self.out.exists():
                self.log.seek(0)
                pytest.fail(f"The two-CPU process ended without results (exit {self.process.returncode}):\n"
                            f"{self.log.read()[-4000:]}", pytrace=False)
            self._results = json.loads(self.out.read_text())
        return self._results[example_id]

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _selected_two_cpu_examples(session):
    return [item.callspec.params["example_id"] for item in session.items
            if hasattr(item, "callspec") and _base(item.callspec.params.get("example_id", "")) in NEEDS_TWO_CPUS]


@pytest.fixture(scope="module")
def two_cpu_process(tmp_path_factory, request):
    process = TwoCpuProcess(tmp_path_factory.mktemp("two-cpus"), _selected_two_cpu_examples(request.session))
    yield process
    process.close()


# The two-CPU examples last: their process starts with the first example and runs meanwhile.
@pytest.mark.parametrize("example_id", [i for i in EXAMPLES if i not in TWO_CPU_IDS] + TWO_CPU_IDS)
def test_example_runs(example_id, tmp_path, monkeypatch, request):
    if _base(example_id) in CANNOT_RUN:
        pytest.skip(CANNOT_RUN[_base(example_id)])
    if _selected_two_cpu_examples(request.session):
        two_cpus = request.getfixturevalue("two_cpu_process")
    if _base(example_id) in NEEDS_TWO_CPUS:
        error = two_cpus.error(example_id)
        if error:
            pytest.fail(f"In a process that ran lab.virtual_cpus(2) first:\n{error}", pytrace=False)
        return
    monkeypatch.chdir(tmp_path)
    run_example(example_id)


def test_every_example_block_is_collected():
    """No ```python block in lab/ or widgets/ escapes the collection (a nested function's, say)."""
    in_source = {}
    for package_name in PACKAGES:
        for path in sorted((ROOT / package_name).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if _other_backend(module):
                continue
            count = len(EXAMPLE_BLOCK.findall(path.read_text()))
            if count:
                in_source[module] = count
    collected = {}
    for _, module_name in EXAMPLES.values():
        collected[module_name] = collected.get(module_name, 0) + 1
    assert collected == in_source


def test_the_names_that_need_two_cpus_and_the_skips_name_examples():
    """A renamed object must not leave a stale entry that silently covers nothing."""
    names = {_base(i) for i in EXAMPLES}
    assert set(NEEDS_TWO_CPUS) | set(CANNOT_RUN) <= names
