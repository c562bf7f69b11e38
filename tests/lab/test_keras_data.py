"""The ways users feed data to fit(), with the lab attached.

Users rarely hand fit() plain NumPy arrays only: they pad variable-length
sequences with `padded_batch`, wrap Python generators with
`from_generator`, batch ragged sequences, repeat a dataset under
`steps_per_epoch`, end an epoch with a partial batch, shuffle with a seed,
prefetch and cache; they read images and texts from directories with
`keras.utils.image_dataset_from_directory` and
`text_dataset_from_directory`, window series with
`timeseries_dataset_from_array`; they feed dicts to models of several named
inputs (numbers and strings), pandas DataFrames, Python generators of
`(x, y)` or `(x, y, sample_weight)`, a `keras.utils.PyDataset` read by
worker threads, and validate on a dataset or a `validation_split`. Two
keras-io paths are followed as they train:

- examples/structured_data/structured_data_classification_with_feature_space.py:
  a `keras.utils.FeatureSpace` adapted on a dataset of dicts (numbers and a
  string feature), applied in tf.data, a model on its encoded features;
- examples/nlp/text_classification_from_scratch.py: a `TextVectorization`
  adapted on the texts, applied in tf.data (`map(vectorize_text)`, `cache`,
  `prefetch`) for a Conv1D model; and its end-to-end form, the layer inside
  a model fit on raw strings.

Each case is a small model on data generated here or written to a temporary
directory, fit for two epochs of four batches bare and with
`lab.Recorder(gradients=True, weights=True)` (same seeds), and:

1. the History, the model's variables and the optimizer's equal bare fit()'s
   bit for bit; the run has one row per batch, and its loss column's running
   mean (weighted by the batch sizes, as Keras' loss tracker weighs them) is
   the loss Keras logs at each batch;
2. a graph `lab.Stepper` on the same data steps to fit()'s first epoch, its
   first trace holds the first batch, and a rewind and replay end there again;
3. `lab.inspect_data(x, model=model)` reports on the data without a problem,
   and lists its leaves (string ones as strings);
4. `lab.predict_stream` yields what `model.predict` returns, batch by batch;
5. the run saved to HDF5 loads back with the same rows.

Two forms fit() itself treats in its own way: NumPy string arrays, which its
array adapter refuses ("Invalid dtype"; inspect_data names them and the fix,
a tf.Tensor), and a dataset of unknown length (from_generator), each epoch of
which fit() ends with a call that finds no batch yet counts an optimizer step
(the Stepper and inspect_data say so; stepping a second epoch parts from
fit()'s: UNKNOWN_LENGTH, an xfail).
"""

import dataclasses
import inspect
import math
import os
import pathlib
import warnings

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import lab

L = keras.layers
BATCH, BATCHES, EPOCHS = 8, 4, 2
N = BATCH * BATCHES
SEED = 3

# Datasets fit() is given with its default shuffle=True: Keras warns that it ignores it.
# A dataset of unknown length (from_generator) ends fit()'s first epoch with a warning that it ran out.
pytestmark = [pytest.mark.filterwarnings("ignore:`shuffle=True` was passed:UserWarning"),
              pytest.mark.filterwarnings("ignore:Your input ran out of data:UserWarning")]

# Written once per session by the `files` fixture: images, texts.
FILES = {}


def rng(offset=0):
    return np.random.default_rng(SEED + offset)


def compiled(inputs, outputs, loss="sparse_categorical_crossentropy", metrics=("accuracy",)):
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), loss, metrics=list(metrics))
    return model


def classifier(inputs, h, k=2):
    return compiled(inputs, L.Dense(k, activation="softmax", name="head")(h))


def features(n=N, width=4):
    return rng().normal(size=(n, width)).astype("float32")


def labels(x, k=2):
    flat = np.asarray(x, "float64").reshape(len(x), -1)
    return (np.abs(flat).sum(axis=1) * 7).astype("int64") % k


@dataclasses.dataclass
class Case:
    """One way of feeding fit(). The factories make fresh data at each call
    (a generator runs through once, a seeded shuffle restarts its order)."""

    model: keras.Model
    fit: object  # () -> dict of fit() arguments (x, y, batch_size, steps_per_epoch, validation_*)
    step: object  # () -> (data, dict of Stepper arguments)
    sizes: tuple = (BATCH,) * BATCHES  # each batch's size in an epoch
    predict: object = None  # () -> (predict()'s x, dict of its arguments), or None
    inspect: object = None  # () -> dict of inspect_data arguments, or None for fit()'s
    strings: tuple = ()  # input paths inspect_data should list as strings
    unknown_length: bool = False  # a dataset of unknown cardinality (see UNKNOWN_LENGTH)


def vector_model(width=4):
    inputs = keras.Input((width,))
    return classifier(inputs, L.Dense(8, activation="relu")(inputs))


def arrays_case(model, x, y, **fit_extra):
    return Case(model, lambda: dict(x=x, y=y, batch_size=BATCH, shuffle=False, **fit_extra),
                lambda: ((x, y), dict(batch_size=BATCH, shuffle=False)),
                predict=lambda: (x, dict(batch_size=BATCH)))


def dataset_case(model, make_dataset, sizes=(BATCH,) * BATCHES, **fit_extra):
    return Case(model, lambda: dict(x=make_dataset(), **fit_extra), lambda: (make_dataset(), {}), sizes=sizes,
                predict=lambda: (make_dataset(), {}))


def unknown_length(case):
    case.unknown_length = True
    return case


# ---- tf.data ---------------------------------------------------------------------------------------


def sequences(n=N, vocabulary=12, longest=7):
    r = rng(1)
    seqs = [r.integers(1, vocabulary, size=r.integers(1, longest + 1)).astype("int32") for _ in range(n)]
    return seqs, np.array([int(s.sum()) % 2 for s in seqs])


def padded_embedding():
    """from_generator of variable-length token ids, padded per batch; the
    Embedding's mask (mask_zero) keeps the padding out of the pooled mean."""
    seqs, y = sequences()
    inputs = keras.Input((None,), dtype="int32")
    model = classifier(inputs, L.GlobalAveragePooling1D()(L.Embedding(12, 4, mask_zero=True)(inputs)))

    def dataset():
        return tf.data.Dataset.from_generator(
            lambda: zip(seqs, y), output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int64))
        ).padded_batch(BATCH)
    return unknown_length(dataset_case(model, dataset))


def padded_masking():
    """Variable-length float sequences padded with zeros by padded_batch, Masking(0.0) before a SimpleRNN."""
    r = rng(2)
    seqs = [r.normal(size=(r.integers(1, 7), 2)).astype("float32") + 3.0 for _ in range(N)]
    y = np.array([int(s[:, 0].sum() > 3 * len(s)) for s in seqs])
    inputs = keras.Input((None, 2))
    model = classifier(inputs, L.SimpleRNN(4)(L.Masking(0.0)(inputs)))

    def dataset():
        return tf.data.Dataset.from_generator(
            lambda: zip(seqs, y),
            output_signature=(tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([], tf.int64)),
        ).padded_batch(BATCH, padding_values=(0.0, np.int64(0)))
    return unknown_length(dataset_case(model, dataset))


class Densify(L.Layer):
    """A ragged batch as a dense one, zero-padded (to the batch's longest sequence)."""

    def call(self, x):
        return x.to_tensor() if isinstance(x, tf.RaggedTensor) else x


def ragged():
    seqs, y = sequences()
    inputs = keras.Input((None,), dtype="int32", ragged=True)
    model = classifier(inputs, L.GlobalAveragePooling1D()(Densify()(L.Embedding(12, 4)(inputs))))

    def dataset():
        return tf.data.Dataset.from_tensor_slices((tf.ragged.constant(seqs, dtype=tf.int32), y)).batch(BATCH)
    return dataset_case(model, dataset)


def repeated():
    """An endless dataset, split into epochs by steps_per_epoch (the second
    epoch takes the next batches of the same pass: data of 6 batches)."""
    x = features(6 * BATCH)
    y = labels(x)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    case = dataset_case(vector_model(), dataset, steps_per_epoch=BATCHES)
    case.step = lambda: (dataset(), dict(steps_per_epoch=BATCHES))
    case.predict = lambda: (dataset(), dict(steps=BATCHES))
    case.inspect = lambda: dict(x=dataset(), steps_per_epoch=BATCHES)
    return case


def partial_batch():
    x = features(N - 3)
    y = labels(x)
    return dataset_case(vector_model(), lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
                        sizes=(BATCH,) * (BATCHES - 1) + (BATCH - 3,))


def shuffled():
    """A seeded shuffle, reshuffled each epoch."""
    x = features()
    y = labels(x)
    return dataset_case(vector_model(),
                        lambda: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=7).batch(BATCH))


def cached_and_prefetched():
    """A mapped dataset cached to a file (the first epoch writes it, the second
    reads it), mapped again in parallel and prefetched."""
    x = features()
    y = labels(x)
    made = []

    def dataset():
        made.append(None)
        path = os.path.join(FILES["root"], f"cache-{id(made)}-{len(made)}")
        return (tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a + 1.0, b)).cache(path).batch(BATCH)
                .map(lambda a, b: (a * 2.0, b), num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))
    return dataset_case(vector_model(), dataset)


# ---- keras.utils dataset builders ------------------------------------------------------------------


def image_directory():
    model = classifier(*_image_layers())

    def dataset():
        return keras.utils.image_dataset_from_directory(FILES["images"], image_size=(8, 8), batch_size=BATCH,
                                                        seed=1, verbose=False)
    return dataset_case(model, dataset)


def _image_layers():
    inputs = keras.Input((8, 8, 3))
    h = L.Conv2D(2, 3, activation="relu")(L.Rescaling(1 / 255)(inputs))
    return inputs, L.GlobalAveragePooling2D()(h)


def text_dataset():
    return keras.utils.text_dataset_from_directory(FILES["texts"], batch_size=BATCH, seed=1)


def standardize(text):
    # text_classification_from_scratch.py's custom_standardization, HTML breaks and punctuation stripped.
    return tf.strings.regex_replace(tf.strings.regex_replace(tf.strings.lower(text), "<br />", " "), "[.,!?]", "")


def vectorizer():
    layer = L.TextVectorization(standardize=standardize, max_tokens=40, output_mode="int", output_sequence_length=10)
    layer.adapt(text_dataset().map(lambda x, y: x))
    return layer


def text_vectorized():
    """keras-io text_classification_from_scratch.py: the texts vectorized in
    tf.data, cached and prefetched, into an Embedding, Dropout and Conv1D."""
    layer = vectorizer()
    inputs = keras.Input((None,), dtype="int64")
    h = L.Dropout(0.5)(L.Embedding(40, 4)(inputs))
    h = L.GlobalMaxPooling1D()(L.Conv1D(4, 3, activation="relu")(h))
    model = compiled(inputs, L.Dense(1, activation="sigmoid")(h), loss="binary_crossentropy")

    def dataset(batches=None):
        texts = text_dataset() if batches is None else text_dataset().take(batches)
        return texts.map(lambda text, y: (layer(tf.expand_dims(text, -1)), y)).cache().prefetch(10)
    return dataset_case(model, dataset, validation_data=dataset(2))


def text_end_to_end():
    """The same model with the TextVectorization inside, fit on raw strings."""
    layer = vectorizer()
    inputs = keras.Input((1,), dtype="string")
    h = L.Dropout(0.5)(L.Embedding(40, 4)(layer(inputs)))
    h = L.GlobalMaxPooling1D()(L.Conv1D(4, 3, activation="relu")(h))
    model = compiled(inputs, L.Dense(1, activation="sigmoid")(h), loss="binary_crossentropy")
    case = dataset_case(model, lambda: text_dataset().map(lambda text, y: (tf.expand_dims(text, -1), y)))
    case.strings = ("x",)
    return case


def timeseries():
    """Windows of 5 steps of a series (N windows), shuffled with a seed; the target of the window at i is targets[i]."""
    series = rng().normal(size=(N + 4, 2)).astype("float32").cumsum(axis=0)
    targets = (series[:, 0] > np.roll(series[:, 0], -4)).astype("int64")
    inputs = keras.Input((5, 2))
    model = classifier(inputs, L.GlobalAveragePooling1D()(L.Conv1D(4, 3)(inputs)))
    return dataset_case(model, lambda: keras.utils.timeseries_dataset_from_array(
        series, targets, sequence_length=5, batch_size=BATCH, shuffle=True, seed=1))


# ---- structured data: dicts, FeatureSpace ---------------------------------------------------------

CITIES = np.array(["paris", "oslo", "lima", "kyiv"])


def table(n=N):
    r = rng(4)
    frame = pd.DataFrame({"age": r.integers(20, 70, n).astype("float32"), "rate": r.normal(size=n).astype("float32"),
                          "kind": r.integers(0, 3, n).astype("int64"), "city": CITIES[r.integers(0, 4, n)]})
    target = ((frame["age"] > 45) ^ (frame["city"] == "oslo")).astype("int64").to_numpy()
    return frame, target


def feature_space():
    """keras-io structured_data_classification_with_feature_space.py: a
    FeatureSpace adapted on a dataset of dicts without labels, applied in
    tf.data, a model on its encoded features."""
    frame, target = table()
    space = keras.utils.FeatureSpace(
        features={"kind": keras.utils.FeatureSpace.integer_categorical(num_oov_indices=0),
                  "city": keras.utils.FeatureSpace.string_categorical(num_oov_indices=0),
                  "age": keras.utils.FeatureSpace.float_discretized(num_bins=4),
                  "rate": keras.utils.FeatureSpace.float_normalized()},
        crosses=[keras.utils.FeatureSpace.cross(feature_names=("kind", "city"), crossing_dim=8)],
        output_mode="concat")

    def raw():
        return tf.data.Dataset.from_tensor_slices((dict(frame), target)).batch(BATCH)
    space.adapt(raw().map(lambda x, _: x))
    encoded = space.get_encoded_features()
    h = L.Dropout(0.5)(L.Dense(8, activation="relu")(encoded))
    model = compiled(encoded, L.Dense(1, activation="sigmoid")(h), loss="binary_crossentropy")
    return dataset_case(model, lambda: raw().map(lambda x, y: (space(x), y), num_parallel_calls=tf.data.AUTOTUNE)
                        .prefetch(tf.data.AUTOTUNE))


def dict_inputs():
    """A dict of named inputs, numbers and strings (StringLookup inside the model), as arrays."""
    frame, target = table()
    inputs = {"age": keras.Input((1,), name="age"), "rate": keras.Input((1,), name="rate"),
              "city": keras.Input((1,), dtype="string", name="city")}
    city = L.StringLookup(vocabulary=list(CITIES[:3]), output_mode="one_hot")(inputs["city"])
    h = L.Concatenate()([L.Rescaling(1 / 50)(inputs["age"]), inputs["rate"], city])
    model = classifier(inputs, L.Dense(8, activation="relu")(h))
    # Keras 3.15 refuses NumPy string arrays ("Invalid dtype: str..."): strings as a tf.Tensor.
    x = {"age": frame["age"].to_numpy()[:, None], "rate": frame["rate"].to_numpy()[:, None],
         "city": tf.constant(frame["city"].to_numpy().astype(str)[:, None])}
    case = arrays_case(model, x, target)
    case.strings = ("x['city']",)
    return case


def dataframe():
    """A pandas DataFrame as x, a Series as y."""
    frame, target = table()
    x = frame[["age", "rate", "kind"]].astype("float32")
    inputs = keras.Input((3,))
    model = classifier(inputs, L.Dense(8, activation="relu")(L.Normalization(mean=[45.0, 0.0, 1.0], variance=[200.0, 1.0, 1.0])(inputs)))
    return arrays_case(model, x, pd.Series(target))


# ---- Python generators, PyDataset, validation ------------------------------------------------------


def python_generator(weighted):
    x = features()
    y = labels(x)
    w = rng(5).uniform(0.5, 2.0, N).astype("float32")

    def generator():
        while True:  # endless, as fit() over several epochs needs it
            for start in range(0, N, BATCH):
                rows = slice(start, start + BATCH)
                yield (x[rows], y[rows], w[rows]) if weighted else (x[rows], y[rows])

    return Case(vector_model(), lambda: dict(x=generator(), steps_per_epoch=BATCHES),
                lambda: (generator(), dict(steps_per_epoch=BATCHES)),
                predict=lambda: (generator(), dict(steps=BATCHES)),
                inspect=lambda: dict(x=generator(), steps_per_epoch=BATCHES))


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return math.ceil(len(self.x) / BATCH)

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def py_dataset():
    """A PyDataset read by two worker threads."""
    x = features()
    y = labels(x)

    def batches():
        return Batches(x, y, workers=2, use_multiprocessing=False)
    return Case(vector_model(), lambda: dict(x=batches(), shuffle=False),
                lambda: (batches(), dict(shuffle=False)), predict=lambda: (batches(), {}))


def validation_split():
    """fit() holds out the last 20% of the arrays; the Stepper is given the rest."""
    x = features(40)
    y = labels(x)
    case = arrays_case(vector_model(), x, y, validation_split=0.2)
    case.step = lambda: ((x[:N], y[:N]), dict(batch_size=BATCH, shuffle=False))
    case.inspect = lambda: dict(x=x, y=y, batch_size=BATCH, validation_split=0.2)
    case.predict = lambda: (x[:N], dict(batch_size=BATCH))
    return case


CASES = {
    "tf.data/from_generator+padded_batch+Embedding(mask_zero)": padded_embedding,
    "tf.data/from_generator+padded_batch+Masking": padded_masking,
    "tf.data/ragged": ragged,
    "tf.data/repeat+steps_per_epoch": repeated,
    "tf.data/partial_last_batch": partial_batch,
    "tf.data/shuffle(seed)": shuffled,
    "tf.data/map+cache(file)+prefetch": cached_and_prefetched,
    "image_dataset_from_directory": image_directory,
    "text_dataset_from_directory+TextVectorization(map)+validation_data": text_vectorized,
    "text_dataset_from_directory+TextVectorization(in model)": text_end_to_end,
    "timeseries_dataset_from_array": timeseries,
    "FeatureSpace(tf.data)": feature_space,
    "dict(numeric+string)+StringLookup": dict_inputs,
    "pandas.DataFrame": dataframe,
    "generator(x, y)": lambda: python_generator(weighted=False),
    "generator(x, y, sample_weight)": lambda: python_generator(weighted=True),
    "PyDataset(workers=2)": py_dataset,
    "validation_split": validation_split,
}


# Cases the oldest supported Keras cannot build: case -> (whether it can, why not).
LATER = {"tf.data/ragged": ("ragged" in inspect.signature(keras.Input).parameters,
                            f"keras.Input(ragged=True) is newer than Keras {keras.__version__}")}


def params():
    return [pytest.param(name, marks=pytest.mark.skipif(not LATER[name][0], reason=LATER[name][1]))
            if name in LATER else name for name in CASES]


# ---- files ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("keras_data")
    images, texts = root / "images", root / "texts"
    r = rng(6)
    words = ["good", "bad", "fine", "poor", "great", "awful", "film", "plot", "acting", "music"]
    for label in ("cats", "dogs"):
        (images / label).mkdir(parents=True)
        (texts / label).mkdir(parents=True)
        for i in range(N // 2):
            base = 60 if label == "cats" else 180
            pixels = np.clip(r.normal(base, 40, size=(8, 8, 3)), 0, 255).astype("uint8")
            # TensorFlow's PNG encoder: keras.utils.save_img needs PIL, which the oldest stack lacks.
            tf.io.write_file(str(images / label / f"{i:02d}.png"), tf.io.encode_png(pixels))
            chosen = r.choice(words[:6] if label == "cats" else words[3:], size=r.integers(3, 9))
            (texts / label / f"{i:02d}.txt").write_text(" ".join(chosen).capitalize() + ".<br />The end!")
    FILES.update(root=str(root), images=str(images), texts=str(texts))
    return FILES


# ---- the runs -------------------------------------------------------------------------------------


def make(name):
    keras.utils.set_random_seed(SEED)
    return CASES[name]()


def state(model, counter=True):
    """The bytes of the model's and the optimizer's variables; without the
    optimizer's step counter where `counter` is False."""
    variables = model.variables + model.optimizer.variables
    return [v.numpy().tobytes() for v in variables if counter or v is not model.optimizer.iterations]


class BatchLogs(keras.callbacks.Callback):
    """Keras' logs at each batch's end, and the model's state as the first epoch ends."""

    def __init__(self):
        super().__init__()
        self.rows, self.first_epoch = [], None

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append({key: float(value) for key, value in logs.items()})

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.first_epoch = state(self.model)


def fitted(name, callback):
    case = make(name)
    keras.utils.set_random_seed(SEED + 1)
    history = case.model.fit(epochs=EPOCHS, verbose=0, callbacks=[callback], **case.fit()).history
    return case, history


_BARE, _RECORDED = {}, {}


def bare(name):
    if name not in _BARE:
        logs = BatchLogs()
        case, history = fitted(name, logs)
        _BARE[name] = case, history, logs
    return _BARE[name]


def recorded(name):
    if name not in _RECORDED:
        recorder = lab.Recorder(gradients=True, weights=True)
        case, history = fitted(name, recorder)
        _RECORDED[name] = case, history, recorder
    return _RECORDED[name]


def check_loss_column(rows, logs, sizes):
    """The rows' loss is each batch's own: its running mean over the epoch,
    weighted by the batch sizes as Keras' loss tracker weighs it, is the loss
    Keras logs at each batch."""
    values = rows["loss"].to_numpy(np.float64).reshape(EPOCHS, len(sizes))
    logged = np.array([r["loss"] for r in logs]).reshape(EPOCHS, len(sizes))
    weights = np.asarray(sizes, np.float64)
    mean = np.cumsum(values * weights, axis=1) / np.cumsum(weights)
    np.testing.assert_array_equal(values[:, 0], logged[:, 0], err_msg="a first batch's loss is not Keras'")
    np.testing.assert_allclose(mean, logged, rtol=2e-6, err_msg="the rows' running mean is not Keras' logged loss")


# ---- the checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", params())
def test_each_data_form_trains_as_bare_fit_with_a_recorder(name, tmp_path):
    case, bare_history, logs = bare(name)
    labbed, history, recorder = recorded(name)
    assert history == bare_history
    assert state(labbed.model) == state(case.model), "the recorded fit() parted from bare fit()'s state"
    rows = recorder.run.batches()
    assert len(rows) == EPOCHS * len(case.sizes) == len(logs.rows)
    assert list(rows["step"]) == list(range(len(rows)))
    check_loss_column(rows, logs.rows, case.sizes)
    assert rows["grad_norm"].notna().all() and (rows["grad_norm"] > 0).all()
    warned = recorder.run.events().query("kind == 'warning'")["detail"].tolist()
    assert not warned, f"the run warns of a fit() it recorded exactly: {warned}"
    for variable in labbed.model.trainable_variables:
        assert rows[f"weight_norm/{variable.path}"].notna().all(), variable.path
    for key, values in bare_history.items():
        assert list(recorder.run.epochs()[key]) == pytest.approx(values, rel=1e-6), key
    # 5. The run, saved to HDF5, loads back with the same rows.
    path = recorder.run.save(tmp_path / "run.h5")
    loaded = lab.Run.load(path)
    pd.testing.assert_frame_equal(loaded.batches(), rows)
    pd.testing.assert_frame_equal(loaded.epochs(), recorder.run.epochs())


def first_x(data, stepper_kwargs):
    """The inputs of the first batch fit() takes from `data`."""
    if isinstance(data, tf.data.Dataset):
        element = next(iter(data))
    elif isinstance(data, keras.utils.PyDataset):
        element = data[0]
    elif hasattr(data, "__next__"):
        element = next(data)
    else:
        x = data[0]
        count = stepper_kwargs.get("batch_size", BATCH)
        return keras.tree.map_structure(lambda a: np.asarray(a[:count]), x)
    return element[0] if isinstance(element, tuple) else element


def same_leaves(got, expected):
    """The trace's batch (numpy; a ragged one as an array of rows) holds `expected`'s values."""
    got, expected = keras.tree.flatten(got), keras.tree.flatten(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, tf.RaggedTensor):
            assert len(g) == int(e.nrows())
            assert [np.asarray(row).tolist() for row in g] == e.to_list()
        else:
            e = np.asarray(e)
            assert np.asarray(g).shape == e.shape and (np.asarray(g) == e).all()


def same_state(model, expected, case):
    """Whether the model's state is `expected` (a `state()`), for a dataset of
    unknown length but for the optimizer's step counter (UNKNOWN_LENGTH)."""
    if not case.unknown_length:
        return state(model) == expected
    position = [v is model.optimizer.iterations for v in model.variables + model.optimizer.variables].index(True)
    return state(model, counter=False) == expected[:position] + expected[position + 1:]


@pytest.mark.newest_only
@pytest.mark.parametrize("name", params())
def test_each_data_form_steps_as_fits_first_epoch_and_replays(name):
    _, _, logs = bare(name)
    case = make(name)
    model = case.model
    initial = [v.numpy().tobytes() for v in model.variables]  # the optimizer is built by the first step
    keras.utils.set_random_seed(SEED + 1)  # as fit() is given its data: a seeded shuffle draws its order from it
    data, kwargs = case.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stepper = lab.Stepper(model, data, mode="graph", **kwargs)
    told = [w for w in caught if str(w.message) == lab.backend.tensorflow.stepper.UNKNOWN_LENGTH_MESSAGE]
    assert bool(told) == case.unknown_length, "the Stepper tells of a dataset of unknown length, and only there"
    trace = stepper.step(len(case.sizes))
    assert trace.error is None, trace.traceback
    assert same_state(model, logs.first_epoch, case), "the Stepper parted from fit()'s first epoch"
    # The first trace shows fit()'s first batch.
    keras.utils.set_random_seed(SEED + 1)
    same_leaves(stepper.traces[0].x, first_x(case.step()[0], kwargs))
    assert [len(keras.tree.flatten(t.y)[0]) for t in stepper.traces] == list(case.sizes)
    stepper.rewind(len(case.sizes))
    assert [v.numpy().tobytes() for v in model.variables] == initial, "the rewind left the model as it was"
    assert int(model.optimizer.iterations.numpy()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a replay that parts from the first run warns
        trace = stepper.step(len(case.sizes))
    assert trace.error is None, trace.traceback
    assert same_state(model, logs.first_epoch, case), "the replay parted from fit()'s first epoch"


@pytest.mark.parametrize("name", params())
def test_inspect_data_reports_each_data_form(name):
    case, _, _ = bare(name)  # its model trained: inspect_data changes none of its variables
    before = state(case.model)
    arguments = case.inspect() if case.inspect is not None else {
        k: v for k, v in case.fit().items() if k in ("x", "y", "batch_size", "steps_per_epoch", "validation_split")}
    report = lab.inspect_data(model=case.model, **arguments)
    assert report.ok, repr(report)
    assert report.structure is not None and report.batch_size == case.sizes[0], repr(report)
    frame = report.frame()
    assert set(frame["part"]) >= {"x", "y"}
    for path in case.strings:
        assert frame.set_index("path").loc[path, "dtype"] == "string", frame
    assert "no problem found" in repr(report)
    assert any("length is unknown" in note for note in report.notes) == case.unknown_length, report.notes
    assert state(case.model) == before


@pytest.mark.parametrize("name", params())
def test_predict_stream_yields_what_predict_returns(name):
    case, _, _ = bare(name)  # its model trained
    data, kwargs = case.predict()
    expected = case.model.predict(data, verbose=0, **kwargs)
    data, kwargs = case.predict()
    streamed = list(lab.predict_stream(case.model, data, **kwargs))
    assert [len(p) for p in streamed] == list(case.sizes)
    np.testing.assert_array_equal(np.concatenate(streamed), expected)


UNKNOWN_LENGTH = (
    "fit() in graph mode on the TensorFlow backend ends each epoch of a dataset of unknown cardinality "
    "(from_generator) with one more train_function call, which finds the iterator empty; the step's stateful "
    "ops that do not wait on the batch have run by then: the optimizer's `iterations.assign_add(1)` and a "
    "Dropout's seed generator (Keras 3.5 and 3.15: iterations 5 after 4 batches, 10 after 8, the seed state "
    "one draw ahead; fit(run_eagerly=True) counts 4 and 8; scratch/keras_iterations_unknown_cardinality.py, "
    "scratch/keras_phantom_call_state.py). The Stepper takes only the steps it is given, so from the second "
    "epoch on its Adam bias correction, learning-rate schedule and dropout masks use other step numbers than "
    "fit()'s, and its weights part from fit()'s. It says so "
    "(lab.backend.tensorflow.stepper.UNKNOWN_LENGTH_MESSAGE), with the fix: "
    "the dataset's length given by tf.data.experimental.assert_cardinality.")


def test_a_dataset_given_its_length_steps_two_epochs_as_fit_trains_them():
    # The fix UNKNOWN_LENGTH_MESSAGE gives: fit() makes no end-of-data call.
    name = "tf.data/from_generator+padded_batch+Embedding(mask_zero)"
    states = []
    for stepped in (False, True):
        case = make(name)
        keras.utils.set_random_seed(SEED + 1)
        data = case.step()[0].apply(tf.data.experimental.assert_cardinality(BATCHES))
        if stepped:
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # nothing to tell
                stepper = lab.Stepper(case.model, data, mode="graph")
            assert stepper.step(EPOCHS * BATCHES).error is None
        else:
            case.model.fit(data, epochs=EPOCHS, verbose=0)
        states.append(state(case.model))
    assert states[0] == states[1], "two epochs of steps parted from fit()'s"


@pytest.mark.filterwarnings("ignore:The dataset's length is unknown:UserWarning")  # told, as it should be
@pytest.mark.xfail(strict=True, reason=UNKNOWN_LENGTH)
@pytest.mark.parametrize("name", ["tf.data/from_generator+padded_batch+Embedding(mask_zero)"])
def test_stepping_two_epochs_of_a_dataset_of_unknown_length_ends_where_fit_ends(name):
    case, _, _ = bare(name)
    stepped = make(name)
    keras.utils.set_random_seed(SEED + 1)
    data, kwargs = stepped.step()
    stepper = lab.Stepper(stepped.model, data, mode="graph", **kwargs)
    trace = stepper.step(EPOCHS * len(stepped.sizes))
    assert trace.error is None and trace.epoch == EPOCHS - 1, trace
    assert [v.numpy().tobytes() for v in stepped.model.variables] == [v.numpy().tobytes() for v in case.model.variables], \
        "two epochs of steps parted from fit()'s weights"


def test_inspect_data_names_the_numpy_strings_fit_refuses():
    # Keras' array adapter takes no NumPy string array (3.5 and 3.15: "Invalid
    # dtype: str..."); fit() fails on it before any step, and so does the report.
    frame, target = table()
    case = make("dict(numeric+string)+StringLookup")
    x = {"age": frame["age"].to_numpy()[:, None], "rate": frame["rate"].to_numpy()[:, None],
         "city": frame["city"].to_numpy().astype(str)[:, None]}
    with pytest.raises(ValueError, match="Invalid dtype"):
        case.model.fit(x, target, batch_size=BATCH, epochs=1, verbose=0)
    report = lab.inspect_data(x, target, batch_size=BATCH, model=case.model)
    assert [p.kind for p in report.problems] == ["dtype"], repr(report)
    assert "x['city']" in report.problems[0].message and "tf.constant" in report.problems[0].fix
    x["city"] = tf.constant(x["city"])  # as the fix says
    assert lab.inspect_data(x, target, batch_size=BATCH, model=case.model).ok
