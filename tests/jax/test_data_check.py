"""inspect_data on JAX: the batches Keras' JAX fit() hands train_step, and the problems named with their fix."""

import keras
import numpy as np
import pytest

import lab

FEATURES, CLASSES, EXAMPLES = 8, 3, 100


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    x = rng.random((EXAMPLES, FEATURES))  # float64: fit() casts it to float32
    y = (np.arange(EXAMPLES) % CLASSES).astype(np.int32)
    return x, y


class Spy(keras.Model):
    """A functional model whose train_step notes each batch fit() hands it."""

    seen = None

    def train_step(self, state, data):
        self.seen.append(data)
        return super().train_step(state, data)


def spy(input_name=None, loss="sparse_categorical_crossentropy", inputs=None, kind=Spy):
    keras.utils.set_random_seed(0)
    inputs = inputs if inputs is not None else keras.Input((FEATURES,), name=input_name)
    flat = keras.layers.concatenate(list(inputs.values())) if isinstance(inputs, dict) else inputs
    model = kind(inputs, keras.layers.Dense(CLASSES)(flat))
    model.compile(optimizer="sgd", loss=loss)
    model.run_eagerly = True  # every batch reaches train_step as itself, not as a trace
    model.seen = []
    return model


def fed(model, *args, **kwargs):
    """The batches one epoch of the model's fit() hands train_step."""
    model.fit(*args, epochs=1, shuffle=False, verbose=0, **kwargs)
    return model.seen


def leaves_of(batch):
    """(part, shape, dtype) of each leaf, in the order the report's frame lists them."""
    parts = zip(("x", "y", "sample_weight"), batch) if isinstance(batch, tuple) else [("x", batch)]
    return [(part, tuple(leaf.shape), str(np.dtype(leaf.dtype)))
            for part, value in parts for leaf in _flat(value)]


def _flat(value):
    if isinstance(value, dict):
        return [leaf for key in value for leaf in _flat(value[key])]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flat(item)]
    return [] if value is None else [value]


STRUCTURES = {1: "(x,)", 2: "(x, y)", 3: "(x, y, sample_weight)"}


def assert_report_is_what_fit_hands(report, batches, counted=True):
    first = batches[0]
    assert report.structure == (STRUCTURES[len(first)] if isinstance(first, tuple) else "x")
    frame = report.frame()
    assert list(zip(frame["part"], frame["shape"], frame["dtype"])) == leaves_of(first)
    if counted:
        assert report.batch_sizes().tolist() == [len(_flat(batch)[0]) for batch in batches]


def only_problem(report, kind):
    assert [p.kind for p in report.problems] == [kind], report
    return report.problems[0]


def fit_fails(model, *args, **kwargs):
    try:
        model.fit(*args, epochs=1, verbose=0, **kwargs)
    except Exception:  # whatever fit() raises
        return True
    return False


# ---- what fit() hands train_step ------------------------------------------------


@pytest.mark.parametrize("parts", ["x, y", "x, y, sample_weight"])
def test_arrays_are_reported_as_fit_batches_them(arrays, parts):
    x, y = arrays
    kwargs = {"sample_weight": np.linspace(0.5, 1.5, EXAMPLES)} if "sample_weight" in parts else {}
    report = lab.inspect_data(x, y, batch_size=32, model=spy(), **kwargs)
    assert report.ok, report
    assert_report_is_what_fit_hands(report, fed(spy(), x, y, batch_size=32, **kwargs))
    assert report.frame().set_index("path").loc["x", "dtype"] == "float32"
    assert "batches per epoch: 4 (first of 32, last of 4)" in repr(report) and "no problem found" in repr(report)


def test_x_alone_reaches_train_step_bare():
    x = np.ones((10, FEATURES), np.float32)
    report = lab.inspect_data(x, batch_size=4)
    assert report.structure == "x" and report.batch_sizes().tolist() == [4, 4, 2]
    assert report.frame()["path"].tolist() == ["x"]


def test_dict_inputs_are_reported_by_key_as_fit_hands_them(arrays):
    x, y = arrays
    data = {"pixels": x[:, :4], "extra": x[:, 4:]}
    inputs = {"pixels": keras.Input((4,), name="pixels"), "extra": keras.Input((4,), name="extra")}
    report = lab.inspect_data(data, y, batch_size=40, model=spy(inputs=inputs))
    assert report.ok, report
    assert_report_is_what_fit_hands(report, fed(spy(inputs=inputs), data, y, batch_size=40))
    assert sorted(report.frame()["path"])[:2] == ["x['extra']", "x['pixels']"]


def test_validation_split_holds_out_the_last_examples_as_fit_does(arrays):
    x, y = arrays
    report = lab.inspect_data(x, y, batch_size=32, validation_split=0.2)
    assert (report.batches_per_epoch, report.last_batch_size) == (3, 16)
    assert any("holds out the last 20 of 100" in note for note in report.notes)
    assert_report_is_what_fit_hands(report, fed(spy(), x, y, batch_size=32, validation_split=0.2))


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, size=40):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]


def test_a_py_dataset_is_reported_as_fit_hands_its_batches(arrays):
    report = lab.inspect_data(Batches(*arrays), batch_size=64, model=spy())
    assert report.ok, report
    assert (report.form, report.batch_size, report.batches_per_epoch, report.last_batch_size) == \
        ("PyDataset", 40, 3, 20)
    assert_report_is_what_fit_hands(report, fed(spy(), Batches(*arrays)))
    assert any("batch_size=64 is not used" in note for note in report.notes)


def test_a_generator_is_reported_from_its_first_batch_with_no_known_length(arrays):
    x, y = arrays

    def batches():
        for start in range(0, EXAMPLES, 25):
            yield x[start:start + 25], y[start:start + 25]

    report = lab.inspect_data(batches(), model=spy())
    assert report.ok, report
    assert_report_is_what_fit_hands(report, fed(spy(), batches()), counted=False)
    assert report.batch_size == 25 and report.batches_per_epoch is None and report.batch_sizes() is None
    assert any("fresh generator" in note for note in report.notes)
    assert any("exhausted" in note and "steps_per_epoch" in note for note in report.notes)
    assert lab.inspect_data(batches(), steps_per_epoch=3).batch_sizes().tolist() == [25, 25, 25]


def test_class_weights_reach_the_batch_as_fit_weighs_them(arrays):
    x, y = arrays
    class_weight = {0: 1.0, 1: 4.0, 7: 2.0}
    report = lab.inspect_data(x, y, batch_size=10, model=spy(), class_weight=class_weight)
    assert report.ok and report.structure == "(x, y, sample_weight)", report
    first = fed(spy(), x, y, batch_size=10, class_weight=class_weight)[0]
    np.testing.assert_array_equal(report.batch[2], np.asarray(first[2]))
    notes = " ".join(report.notes)
    assert "no weight to class 2 (33 examples)" in notes and "weighs class 7, which no training example has" in notes


# ---- problems named with their fix ------------------------------------------------


def test_sparse_labels_outside_the_classes_are_named_though_fit_gives_no_error(arrays):
    x, y = arrays
    report = lab.inspect_data(x, y + 2, model=spy())
    problem = only_problem(report, "labels")
    assert "labels from 2 to 4" in problem.message and f"outputs {CLASSES} classes" in problem.message
    assert "Dense(5)" in problem.fix and "y - y.min()" in problem.fix
    assert not fit_fails(spy(), x, y + 2)  # JAX trains on them without a word


def test_x_and_y_of_different_lengths(arrays):
    x, y = arrays
    problem = only_problem(lab.inspect_data(x, y[:90], model=spy()), "length")
    assert "x has 100" in problem.message and "y has 90" in problem.message
    assert "same number of rows" in problem.fix
    assert fit_fails(spy(), x, y[:90])


def test_inputs_of_the_wrong_shape_for_a_functional_model(arrays):
    x, y = arrays
    report = lab.inspect_data(x.reshape(EXAMPLES, 2, 4), y, model=spy(input_name="pixels"))
    problem = only_problem(report, "input shape")
    assert problem.message == ("x has shape (32, 2, 4) per batch, but the model's input 'pixels' takes "
                               f"(None, {FEATURES}).")
    assert "keras.Input(shape=(2, 4))" in problem.fix
    assert fit_fails(spy(input_name="pixels"), x.reshape(EXAMPLES, 2, 4), y)


def test_missing_targets_for_keras_own_train_step(arrays):
    x, _ = arrays
    report = lab.inspect_data(x, model=spy(kind=keras.Model))
    problem = only_problem(report, "targets")
    assert "The data has no targets y" in problem.message and "fit(x, y)" in problem.fix
    assert report.batches_per_epoch == 4  # counted all the same
    assert fit_fails(spy(kind=keras.Model), x)


def test_dict_keys_unlike_the_input_names(arrays):
    x, y = arrays
    problem = only_problem(lab.inspect_data({"image": x}, y, model=spy(input_name="pixels")), "input names")
    assert "['image']" in problem.message and "{'pixels': ...}" in problem.fix


@pytest.mark.parametrize("case", ["one_hot", "integer", "target_shape"])
def test_labels_and_targets_the_loss_cannot_compare(arrays, case):
    x, y = arrays
    loss, targets, kind, named = {
        "one_hot": ("sparse_categorical_crossentropy", keras.utils.to_categorical(y, CLASSES), "labels", "one-hot"),
        "integer": (keras.losses.CategoricalCrossentropy(from_logits=True), y, "labels", "integer labels"),
        "target_shape": ("mse", y, "target shape", f"the model outputs (32, {CLASSES})"),
    }[case]
    problem = only_problem(lab.inspect_data(x, targets, model=spy(loss=loss)), kind)
    assert named in problem.message


def test_a_generator_of_single_examples(arrays):
    x, y = arrays

    def examples():
        for row in range(EXAMPLES):
            yield x[row], y[row]

    problem = only_problem(lab.inspect_data(examples(), model=spy()), "unbatched")
    assert "single examples" in problem.message and "yield batches" in problem.fix


def test_a_generator_yielding_a_4_tuple(arrays):
    x, y = arrays
    report = lab.inspect_data(iter([(x[:10], y[:10], np.ones(10), np.ones(10))]), model=spy())
    assert "4-tuple" in only_problem(report, "structure").message
    with pytest.raises(ValueError, match="4-tuple.*Fix: yield"):
        report.check()


def test_numpy_strings_are_named_in_keras_words(arrays):
    _, y = arrays
    problem = only_problem(lab.inspect_data(np.array(["a"] * EXAMPLES), y), "dtype")
    assert "Invalid dtype: str32" in problem.message and "numbers" in problem.fix


@pytest.mark.parametrize("data", [
    lambda x, y: dict(x=x, y=y, sample_weight=np.ones(len(y), np.float32)),
    lambda x, y: dict(x=iter([(x[:10], y[:10])])),
    lambda x, y: dict(x=x, y=[y, y]),
], ids=["arrays with sample weights", "generator", "two targets"])
def test_class_weights_on_data_fit_refuses_them_for(arrays, data):
    report = lab.inspect_data(**data(*arrays), class_weight={0: 2.0})
    only_problem(report, "class_weight")
    assert fit_fails(spy(), **data(*arrays), class_weight={0: 2.0})


# ---- the model is left as it was -------------------------------------------------


def drawing_always(layer_class):
    """A Keras layer that draws from its seed generator at inference too (a VAE's sampling, MC dropout)."""

    class Drawing(layer_class):
        def call(self, inputs, training=None):
            return super().call(inputs, training=True)

    return Drawing


def noise():
    return drawing_always(keras.layers.GaussianNoise)(0.1, seed=7)


class Subclassed(keras.Model):
    """Built by its first call, as most JAX models are; draws noise from a seed generator in every mode."""

    def __init__(self):
        super().__init__()
        self.hidden, self.noise = keras.layers.Dense(8), noise()
        self.norm, self.out = keras.layers.BatchNormalization(), keras.layers.Dense(CLASSES)

    def call(self, inputs, training=False):
        return self.out(self.norm(self.noise(self.hidden(inputs)), training=training))


def functional(draw):
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.BatchNormalization()(draw(keras.layers.Dense(8)(inputs)))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))


MODELS = {"seed_generator": lambda: functional(noise()),
          "mc_dropout": lambda: functional(drawing_always(keras.layers.Dropout)(0.5)),
          "unbuilt_subclass": Subclassed}


def compiled(kind):
    keras.utils.set_random_seed(0)
    model = MODELS[kind]()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def model_state(model):
    """(path, value) of every variable fit() moves: the layers' (seed generators too), the optimizer's, the metrics'."""
    moved = {}
    for variable in [*model.variables, *model.optimizer.variables, *(v for m in model.metrics for v in m.variables)]:
        moved.setdefault(id(variable), variable)
    return [(variable.path, np.asarray(variable.value)) for variable in moved.values()]


def assert_same_state(a, b):
    assert len(a) == len(b)  # the twins' paths differ in Keras' numbering of names only
    for (path, left), (_, right) in zip(a, b):
        np.testing.assert_array_equal(left, right, err_msg=path)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_later_fit_trains_bit_for_bit_as_without_inspect_data(arrays, kind):
    x, y = arrays

    def trained(model):
        history = model.fit(x, y, batch_size=25, epochs=2, verbose=0)  # shuffled: NumPy's global generator
        return model_state(model), history.history

    checked = compiled(kind)
    before = model_state(checked) if checked.built else None
    assert lab.inspect_data(x, y, model=checked).ok
    if before is not None:
        assert_same_state(model_state(checked), before)
    state, history = trained(checked)
    bare_state, bare_history = trained(compiled(kind))
    assert_same_state(state, bare_state)
    assert history == bare_history


def test_a_model_whose_call_fails_is_named_and_left_as_it_was(arrays):
    x, y = arrays

    class Masked(keras.Model):
        def __init__(self):
            super().__init__()
            self.noise, self.dense = noise(), keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(self.noise(inputs["pixels"]) * inputs["mask"])

    model = Masked()
    model.compile(optimizer="sgd", loss="mse")
    seed_state = np.asarray(model.noise.seed_generator.state.value)
    problem = only_problem(lab.inspect_data({"pixels": x, "masks": np.ones_like(x)}, y, model=model), "input names")
    assert problem.message == ("The model's call() reads x['mask'], but x has no key 'mask' "
                               "(its keys are ['masks', 'pixels']).")
    assert problem.fix.startswith("rename x['masks'] to x['mask']")
    np.testing.assert_array_equal(np.asarray(model.noise.seed_generator.state.value), seed_state)


# ---- arguments --------------------------------------------------------------------


@pytest.mark.parametrize("argument, bad, error", [
    ("batch_size", 0, ValueError), ("batch_size", 2.5, TypeError), ("steps_per_epoch", 0, ValueError),
    ("validation_split", 1.0, ValueError), ("validation_split", "0.2", TypeError)])
def test_bad_arguments_are_refused_at_the_call(arrays, argument, bad, error):
    with pytest.raises(error, match=rf"lab.inspect_data\({argument}=\.\.\.\) must be .*\(e.g. "):
        lab.inspect_data(*arrays, **{argument: bad})


def test_a_model_or_class_weight_of_the_wrong_kind_is_refused_at_the_call(arrays):
    with pytest.raises(TypeError, match=r"lab.inspect_data\(model=...\) must be a keras.Model"):
        lab.inspect_data(*arrays, model="model")
    with pytest.raises(TypeError, match=r"lab.inspect_data\(class_weight=...\) must be a dict"):
        lab.inspect_data(*arrays, class_weight=[1.0, 2.0])


def test_data_of_no_form_fit_takes_is_a_problem_naming_the_forms(arrays):
    problem = only_problem(lab.inspect_data("images/", arrays[1]), "data form")
    assert "PyDataset or a generator" in problem.fix and "tf.data" not in problem.fix


# ---- data parallelism ---------------------------------------------------------------

DATA_PARALLEL = r"""
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, {tests!r})
import lab
lab.virtual_cpus(2)
import keras
from jax_models import classification_data, make_mlp
x, y = classification_data(n=100)
with lab.strategy("cpu:0,1").scope():
    for count, batch_size in ((100, 33), (99, 32), (100, 32)):
        report = lab.inspect_data(x[:count], y[:count], batch_size=batch_size, model=make_mlp())
        try:
            make_mlp().fit(x[:count], y[:count], batch_size=batch_size, verbose=0)
            trained = "trained"
        except Exception:
            trained = "failed"
        print("|".join([str(count) + "/" + str(batch_size), trained] + [p.kind + ": " + p.message + " Fix: " + p.fix
                                                              for p in report.problems]))
"""


def test_a_batch_the_devices_cannot_share_evenly_is_named_where_fit_fails_on_it():
    import pathlib
    import subprocess
    import sys

    script = DATA_PARALLEL.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split("|")[0]: line.split("|")[1:] for line in done.stdout.strip().splitlines()}
    first, last, even = lines["100/33"], lines["99/32"], lines["100/32"]
    assert first[0] == "failed" and len(first) == 2 and first[1].startswith("replicas: The first batch of an "
                                                                            "epoch holds 33 examples")
    assert "DataParallel over 2 devices" in first[1] and "a multiple of 2: 32 or 34." in first[1]
    assert last[0] == "failed" and len(last) == 2 and "The last batch of an epoch holds 3 examples" in last[1]
    assert "give fit() 1 example fewer" in last[1]
    assert even == ["trained"]
