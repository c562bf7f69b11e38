"""inspect_data: the batches fit() hands train_step, and the structure errors named with their fix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

FEATURES, CLASSES = 8, 3


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    x = rng.random((100, FEATURES)).astype(np.float32)
    y = (np.arange(100) % CLASSES).astype(np.int32)
    return x, y


def classifier(loss="sparse_categorical_crossentropy", input_name=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,), name=input_name)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.get(loss) if isinstance(loss, str) else loss)
    return model


def only_problem(report, kind):
    assert [p.kind for p in report.problems] == [kind], report
    return report.problems[0]


class Noise(keras.layers.Layer):
    """Draws in every mode from its own SeedGenerator, like keras-io's VAE `Sampling` layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, inputs):
        return inputs + keras.random.normal(keras.ops.shape(inputs), stddev=0.1, seed=self.seed_generator)


class MCDropout(keras.layers.Dropout):
    """Monte Carlo dropout: drops at inference too."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=True)


def model_state(model):
    """Every variable: the layers' (seed generators included), the metrics' and the optimizer's."""
    variables = {id(v): v for v in model.variables + model.optimizer.variables}
    variables.update({id(v): v for metric in model.metrics for v in metric.variables})
    return [np.array(v.numpy()) for v in variables.values()]


def same_state(a, b):
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


# ---- data forms ---------------------------------------------------------------


def test_arrays_are_batched_as_fit_batches_them_with_a_partial_last_batch(arrays):
    x, y = arrays
    report = lab.inspect_data(x, y, batch_size=32)
    assert report.structure == "(x, y)"
    assert (report.batch_size, report.batches_per_epoch, report.last_batch_size) == (32, 4, 4)
    assert report.batch_sizes().tolist() == [32, 32, 32, 4]
    frame = report.frame()
    assert frame["path"].tolist() == ["x", "y"]
    assert frame["shape"].tolist() == [(32, FEATURES), (32,)]
    assert "batches per epoch: 4 (first of 32, last of 4)" in repr(report)
    assert report.ok and "no problem found" in repr(report)


def test_fit_default_batch_size_is_32_and_float64_arrives_as_float32(arrays):
    x, y = arrays
    report = lab.inspect_data(x.astype(np.float64), y)
    assert report.batch_size == 32
    assert report.frame().set_index("path").loc["x", "dtype"] == "float32"


def test_x_alone_reaches_train_step_bare_and_sample_weight_is_the_third_element(arrays):
    x, y = arrays
    assert lab.inspect_data(x).structure == "x"
    report = lab.inspect_data(x, y, sample_weight=np.ones(100), batch_size=50)
    assert report.structure == "(x, y, sample_weight)"
    assert report.frame()["part"].tolist() == ["x", "y", "sample_weight"]


def test_validation_split_holds_out_the_last_examples_before_batching(arrays):
    x, y = arrays
    report = lab.inspect_data(x, y, batch_size=32, validation_split=0.2)
    assert (report.batches_per_epoch, report.last_batch_size) == (3, 16)
    assert any("holds out the last 20 of 100" in note for note in report.notes)


def test_a_batched_dataset_keeps_its_batches_and_ignores_batch_size(arrays):
    dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(40)
    report = lab.inspect_data(dataset, batch_size=64)
    assert (report.batch_size, report.batches_per_epoch, report.last_batch_size) == (40, 3, 20)
    assert any("batch_size=64 is not used" in n and "dataset.batch(64)" in n for n in report.notes)


def test_an_unbatched_dataset_is_named_with_the_fix(arrays):
    report = lab.inspect_data(tf.data.Dataset.from_tensor_slices(arrays))
    problem = only_problem(report, "unbatched")
    assert "single examples" in problem.message and "dataset.batch(32)" in problem.fix
    assert report.batches_per_epoch is None


def test_an_unbatched_dataset_of_x_alone_is_caught_against_the_model(arrays):
    report = lab.inspect_data(tf.data.Dataset.from_tensor_slices(arrays[0]), model=classifier())
    problem = only_problem(report, "unbatched")
    assert f"one example of shape ({FEATURES},)" in problem.message and ".batch(32)" in problem.fix


def test_a_dataset_that_repeats_forever_needs_steps_per_epoch(arrays):
    dataset = tf.data.Dataset.from_tensor_slices(arrays).batch(32).repeat()
    assert "steps_per_epoch" in only_problem(lab.inspect_data(dataset), "epoch length").fix
    report = lab.inspect_data(dataset, steps_per_epoch=5)
    assert report.ok and report.batches_per_epoch == 5


def test_a_generator_has_no_known_length_until_steps_per_epoch_says(arrays):
    x, y = arrays

    def batches():
        for start in range(0, 100, 25):
            yield x[start:start + 25], y[start:start + 25]

    report = lab.inspect_data(batches())
    assert report.structure == "(x, y)" and report.batch_size == 25
    assert report.batches_per_epoch is None and report.batch_sizes() is None
    assert any("exhausted" in note and "steps_per_epoch" in note for note in report.notes)
    assert any("fresh generator" in note for note in report.notes)
    assert lab.inspect_data(batches(), steps_per_epoch=3).batches_per_epoch == 3


def test_a_py_dataset_reports_its_length_and_last_batch(arrays):
    x, y = arrays

    class Digits(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            rows = slice(index * 40, (index + 1) * 40)
            return x[rows], y[rows]

    report = lab.inspect_data(Digits())
    assert (report.form, report.batch_size, report.batches_per_epoch, report.last_batch_size) == \
        ("PyDataset", 40, 3, 20)


# ---- structure errors -----------------------------------------------------------


def test_x_and_y_of_different_lengths(arrays):
    x, y = arrays
    problem = only_problem(lab.inspect_data(x, y[:90]), "length")
    assert "x has 100" in problem.message and "y has 90" in problem.message
    assert "same number of rows" in problem.fix


def test_a_generator_yielding_a_4_tuple(arrays):
    x, y = arrays

    def batches():
        while True:
            yield x[:10], y[:10], np.ones(10), np.ones(10)

    report = lab.inspect_data(batches(), model=classifier())
    problem = only_problem(report, "structure")
    assert "4-tuple" in problem.message and "(x, y, sample_weight)" in problem.fix
    with pytest.raises(ValueError, match="4-tuple.*Fix: yield"):
        report.check()


def test_dict_keys_that_do_not_match_the_input_names(arrays):
    x, y = arrays

    def batches():
        while True:
            yield {"image": x[:10]}, y[:10]

    problem = only_problem(lab.inspect_data(batches(), model=classifier(input_name="pixels")), "input names")
    assert "['image']" in problem.message and "['pixels']" in problem.message
    assert "{'pixels': ...}" in problem.fix
    matching = lab.inspect_data({"pixels": x}, y, model=classifier(input_name="pixels"))
    assert matching.ok, matching


def test_one_hot_labels_with_a_sparse_loss(arrays):
    x, y = arrays
    report = lab.inspect_data(x, keras.utils.to_categorical(y, CLASSES), model=classifier())
    problem = only_problem(report, "labels")
    assert "one-hot" in problem.message and "categorical_crossentropy" in problem.fix


def test_integer_labels_with_the_categorical_loss(arrays):
    x, y = arrays
    model = classifier(keras.losses.CategoricalCrossentropy(from_logits=True))
    problem = only_problem(lab.inspect_data(x, y, model=model), "labels")
    assert "integer labels" in problem.message
    assert "sparse_categorical_crossentropy" in problem.fix and f"to_categorical(y, {CLASSES})" in problem.fix


def test_targets_of_the_wrong_shape(arrays):
    x, y = arrays
    problem = only_problem(lab.inspect_data(x, y, model=classifier("mse")), "target shape")
    assert f"(32,) per batch, the model outputs (32, {CLASSES})" in problem.message
    assert f"({CLASSES},)" in problem.fix


def test_inputs_of_the_wrong_shape(arrays):
    x, y = arrays
    problem = only_problem(lab.inspect_data(x.reshape(100, 2, 4), y, model=classifier()), "input shape")
    assert "(32, 2, 4)" in problem.message and "keras.Input(shape=(2, 4))" in problem.fix


def test_x_alone_for_a_model_that_trains_on_targets_is_named_with_the_fix(arrays):
    report = lab.inspect_data(arrays[0], model=classifier())  # it said "no problem found"; fit() fails on it
    problem = only_problem(report, "targets")
    assert "The data has no targets y" in problem.message and "fit(x, y)" in problem.fix
    assert report.batches_per_epoch == 4
    assert _fit_fails(classifier(), arrays[0])


def test_y_given_beside_a_dataset(arrays):
    x, y = arrays
    report = lab.inspect_data(tf.data.Dataset.from_tensor_slices(x).batch(10), y)
    assert "y was given separately" in only_problem(report, "structure").message


def test_bad_arguments_are_refused_with_the_allowed_range(arrays):
    for argument, bad, error in (("batch_size", 0, ValueError), ("batch_size", 2.5, TypeError),
                                 ("batch_size", "32", TypeError), ("steps_per_epoch", 0, ValueError),
                                 ("validation_split", 1.0, ValueError), ("validation_split", -0.1, ValueError),
                                 ("validation_split", "0.2", TypeError)):
        with pytest.raises(error, match=rf"lab.inspect_data\({argument}=\.\.\.\) must be .*\(e.g. "):
            lab.inspect_data(*arrays, **{argument: bad})
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        lab.inspect_data(*arrays, validation_split=1.0)


def test_checking_against_a_model_leaves_no_trace(arrays):
    x, y = arrays
    model = classifier()
    before = [w.copy() for w in model.get_weights()]
    report = lab.inspect_data(x, y, sample_weight=np.ones(100), model=model)
    assert report.check() is report
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert all(float(v.numpy()) == 0 for metric in model.metrics for v in metric.variables)


@pytest.mark.parametrize("noise", [Noise, lambda: MCDropout(0.5)], ids=["seed_generator", "mc_dropout"])
def test_checking_against_a_model_leaves_what_fit_trains_unchanged(arrays, noise):
    x, y = arrays

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.BatchNormalization()(noise()(keras.layers.Dense(8)(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def trained(model):
        model.fit(x, y, batch_size=50, epochs=1, shuffle=False, verbose=0)
        return model_state(model)

    checked = model()
    before = model_state(checked)
    assert lab.inspect_data(x, y, model=checked).ok
    assert same_state(model_state(checked), before)
    assert same_state(trained(checked), trained(model()))


def test_a_model_that_reads_a_key_x_lacks_is_named_and_left_unchanged(arrays):
    x, y = arrays

    class Masked(keras.Model):
        def __init__(self):
            super().__init__()
            self.noise, self.dense = Noise(), keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(self.noise(inputs["pixels"]) * inputs["mask"])

    model = Masked()
    model.compile(optimizer="sgd", loss="mse")
    seed_state = model.noise.seed_generator.state.numpy()
    report = lab.inspect_data({"pixels": x, "masks": np.ones_like(x)}, y, model=model)
    problem = only_problem(report, "input names")
    assert problem.message == ("The model's call() reads x['mask'], but x has no key 'mask' "
                               "(its keys are ['masks', 'pixels']).")
    assert problem.fix.startswith("rename x['masks'] to x['mask']")
    assert np.array_equal(model.noise.seed_generator.state.numpy(), seed_state)


def test_the_fix_for_wrong_input_keys_names_every_input(arrays):
    x, y = arrays
    first, second = keras.Input((FEATURES,), name="a"), keras.Input((FEATURES,), name="b")
    model = keras.Model([first, second], keras.layers.Dense(1)(keras.layers.concatenate([first, second])))
    model.compile(optimizer="sgd", loss="mse")
    problem = only_problem(lab.inspect_data({"a": x, "c": x}, y, model=model), "input names")
    assert problem.fix.endswith("{'a': ..., 'b': ...}.")


def two_outputs(named):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    outputs = [keras.layers.Dense(1, name="p")(inputs), keras.layers.Dense(1, name="q")(inputs)]
    model = keras.Model(inputs, dict(zip("pq", outputs)) if named else outputs)
    model.compile(optimizer="sgd", loss={"p": "mse", "q": "mse"})
    return model


def test_sample_weights_keyed_unlike_y_are_named_with_the_fix(arrays):
    x, y = arrays[0], arrays[1].astype(np.float32)
    args, kwargs = (x, {"p": y, "q": y}), {"sample_weight": {"p": np.ones(len(x)), "r": np.ones(len(x))}}
    problem = only_problem(lab.inspect_data(*args, model=two_outputs(True), **kwargs), "sample_weight")
    assert problem.message == ("sample_weight has no key 'q' (its keys are ['p', 'r']), but y has keys ['p', 'q']: "
                               "fit() takes one sample-weight array per output, in y's structure.")
    assert problem.fix.startswith("give sample_weight the structure of y: {'p': ..., 'q': ...}")
    assert _fit_fails(two_outputs(True), *args, **kwargs)


def test_sample_weights_keyed_unlike_the_outputs_are_named_with_the_fix(arrays):
    x, y = arrays[0], arrays[1].astype(np.float32)
    weights = np.ones(len(x))
    dataset = tf.data.Dataset.from_tensor_slices((x, {"p": y, "q": y}, {"p": weights, "r": weights})).batch(32)
    report = lab.inspect_data(dataset, model=two_outputs(True))
    if not _fit_fails(two_outputs(True), dataset):  # Keras 3.5 takes them by position
        assert report.ok, report
        return
    problem = only_problem(report, "loss")
    assert problem.message == ("sample_weight has no key 'q' (its keys are ['p', 'r']), and the loss looks "
                               "sample_weight up by the model's output names ['p', 'q'].")
    assert problem.fix == "key sample_weight by the model's output names: {'p': ..., 'q': ...}."


def test_dict_sample_weights_for_a_list_of_outputs(arrays):
    x, y = arrays[0], arrays[1].astype(np.float32)
    args, kwargs = (x, {"p": y, "q": y}), {"sample_weight": {"p": np.ones(len(x)), "q": np.ones(len(x))}}
    report = lab.inspect_data(*args, model=two_outputs(False), **kwargs)
    if not _fit_fails(two_outputs(False), *args, **kwargs):  # Keras 3.5 takes them by output name
        assert report.ok, report
        return
    problem = only_problem(report, "loss")
    assert problem.message == ("sample_weight has no entry 0 (its keys are ['p', 'q']): the model's outputs "
                               "are a list (['p', 'q']), and the loss looks sample_weight up by position.")
    assert problem.fix.startswith("give sample_weight as a list in the order of the model's outputs (and y too")
    assert "keras.Model(inputs, {'p': ..., 'q': ...})" in problem.fix
    assert not _fit_fails(two_outputs(False), x, [y, y], sample_weight=[np.ones(len(x))] * 2)


# ---- the report agrees with fit() -----------------------------------------------


def _fit_fails(model, *args, **kwargs):
    model.run_eagerly = True
    try:
        model.fit(*args, epochs=1, verbose=0, **kwargs)
    except Exception:  # whatever fit() raises
        return True
    return False


@pytest.mark.parametrize("case", ["unbatched", "lengths", "one_hot", "integer", "target_shape", "input_shape"])
def test_every_problem_named_is_one_fit_fails_on(arrays, case):
    x, y = arrays[0][:40], arrays[1][:40]
    model, kwargs = classifier(), {}
    if case == "unbatched":
        args = (tf.data.Dataset.from_tensor_slices((x, y)),)
    elif case == "lengths":
        args = (x, y[:30])
    elif case == "one_hot":
        args = (x, keras.utils.to_categorical(y, CLASSES))
    elif case == "integer":
        model, args = classifier(keras.losses.CategoricalCrossentropy(from_logits=True)), (x, y)
    elif case == "target_shape":
        model, args = classifier("mse"), (x, y)
    else:
        args = (x.reshape(40, 2, 4), y)
    assert not lab.inspect_data(*args, model=model, **kwargs).ok
    assert _fit_fails(model, *args, **kwargs)


@pytest.mark.parametrize("x_shape, input_shape", [((40,), (1,)), ((40, FEATURES, 1), (FEATURES,)),
                                                 ((40, FEATURES), (FEATURES, 1))])
def test_a_trailing_1_that_keras_adds_or_squeezes_is_no_problem(arrays, x_shape, input_shape):
    x, y = np.ones(x_shape, np.float32), arrays[1][:40]
    keras.utils.set_random_seed(0)
    inputs = keras.Input(input_shape, name="x")
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(inputs)))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert lab.inspect_data(x, y, model=model).ok
    assert not _fit_fails(model, x, y)


def test_a_model_built_on_a_dict_of_inputs_takes_x_by_the_dict_keys(arrays):
    x, y = arrays
    inputs = keras.Input((FEATURES,), name="pixels")
    with pytest.warns(UserWarning, match="keys in the dict must match"):
        model = keras.Model({"image": inputs}, keras.layers.Dense(CLASSES)(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert lab.inspect_data({"image": x}, y, model=model).ok
    assert not _fit_fails(model, {"image": x}, y)


def test_a_problem_prints_as_its_message_and_fix(arrays):
    problem = lab.inspect_data(arrays[0], arrays[1][:90]).problems[0]
    assert str(problem) == f"{problem.message}\nfix: {problem.fix}"


def test_error_line_finds_the_message_of_a_graph_error_below_its_traceback(arrays):
    model = classifier("mse")
    with pytest.raises(Exception) as caught:
        # A short last batch makes the batch dimension dynamic: the error comes at run time.
        model.fit(*arrays, batch_size=32, epochs=1, verbose=0)
    line = lab.backend.tensorflow.data_check.error_line(caught.value)
    assert line.startswith("Incompatible shapes") and "[Op:" not in line and "File" not in line


def test_class_weights_reach_the_batch_and_the_classes_they_miss_are_named(arrays):
    x, y = arrays  # classes 0, 1, 2
    report = lab.inspect_data(x, y, batch_size=10, model=classifier(), class_weight={0: 1.0, 1: 4.0, 7: 2.0})
    assert report.ok and report.structure == "(x, y, sample_weight)"
    np.testing.assert_array_equal(report.batch[2], [{0: 1.0, 1: 4.0}.get(int(c), 1.0) for c in y[:10]])
    notes = " ".join(report.notes)
    assert "no weight to class 2 (33 examples): fit() weighs those examples 1.0" in notes
    assert "weighs class 7, which no training example has" in notes


@pytest.mark.parametrize("data", [
    lambda x, y: dict(x=x, y=y, sample_weight=np.ones(len(y), np.float32)),
    lambda x, y: dict(x=tf.data.Dataset.from_tensor_slices((x, y, np.ones(len(y), np.float32))).batch(10)),
    lambda x, y: dict(x=iter([(x[:10], y[:10])])),
    lambda x, y: dict(x=x, y=[y, y]),
], ids=["arrays with sample weights", "dataset with sample weights", "generator", "two targets"])
def test_class_weights_on_data_fit_refuses_them_for_are_a_problem_named_with_its_fix(arrays, data):
    report = lab.inspect_data(**data(*arrays), class_weight={0: 2.0})
    only_problem(report, "class_weight")
    assert "class_weight" in report.problems[0].message or "sample weights" in report.problems[0].message
    assert _fit_fails(classifier(), **data(*arrays), class_weight={0: 2.0})


def test_a_class_weight_that_is_not_a_dict_is_refused_where_given(arrays):
    with pytest.raises(TypeError, match=r"lab.inspect_data\(class_weight=...\) must be a dict"):
        lab.inspect_data(*arrays, class_weight=[1.0, 2.0])


def shuffled_pipeline(kind, tmp_path):
    """A keras-io style pipeline whose order is seeded: shuffle(seed=...) reshuffles at each iteration."""
    features = np.arange(32 * FEATURES, dtype=np.float32).reshape(32, FEATURES) / 100
    labels = np.arange(32, dtype=np.int32) % CLASSES
    examples = tf.data.Dataset.from_tensor_slices((features, labels))
    if kind == "shuffled":
        return examples.shuffle(32, seed=1).batch(8).prefetch(4)
    if kind == "cached in memory, then shuffled":
        return examples.map(lambda x, y: (x * 2, y), num_parallel_calls=4).cache().shuffle(32, seed=1).batch(8).prefetch(4)
    if kind == "shuffled, then cached to a file":
        path = tmp_path / f"cache-{len(list(tmp_path.iterdir()))}"
        return examples.shuffle(32, seed=1).batch(8).cache(str(path)).prefetch(4)
    raise ValueError(kind)


def passes(dataset, count=2):
    return [[np.asarray(leaf).tolist() for batch in dataset for leaf in tf.nest.flatten(batch)] for _ in range(count)]


@pytest.mark.parametrize("kind", ["shuffled", "cached in memory, then shuffled", "shuffled, then cached to a file"])
def test_inspecting_a_dataset_leaves_the_batches_fit_trains_on_unchanged(kind, tmp_path):
    # inspect_data read the user's dataset itself: each iterator it made drew
    # the seeded shuffle's next order, so fit() trained on another order than
    # without it; a cache read for one batch was left half written, which
    # TensorFlow dropped (a file: with a warning) or, racing a prefetch, kept
    # as if whole, and fit() trained on fewer batches (CI, TensorFlow 2.16).
    # The file cache passed before too: it checks that the copy, read through, writes what fit() would.
    model = classifier()  # sets the global seed, which shuffle(seed=...) draws with: before both pipelines
    inspected = shuffled_pipeline(kind, tmp_path)
    report = lab.inspect_data(inspected, model=model)
    assert report.ok and (report.batches_per_epoch, report.last_batch_size) == (4, 8), report
    assert passes(inspected) == passes(shuffled_pipeline(kind, tmp_path)), "fit() would train on other batches"


def test_a_pipeline_that_changes_variables_as_it_runs_is_said_to_have_moved_on():
    flip = keras.layers.RandomFlip("horizontal", seed=3)
    images = tf.data.Dataset.from_tensor_slices((np.ones((16, 4, 4, 1), np.float32), np.zeros(16, np.int32)))
    inputs = keras.Input((4, 4, 1))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Flatten()(inputs)))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    report = lab.inspect_data(images.batch(8).map(lambda x, y: (flip(x, training=True), y)), model=model)
    assert report.ok, report
    assert any("changes variables as it runs" in note for note in report.notes), report.notes


def test_a_dataset_whose_asserted_length_is_wrong_is_a_problem_not_a_crash():
    report = lab.inspect_data(shuffled_pipeline("shuffled", None).apply(tf.data.experimental.assert_cardinality(5)),
                              model=classifier())
    problem = only_problem(report, "data")
    assert "5" in problem.message and "fit()" in problem.fix


def test_a_shuffled_pipeline_too_big_to_copy_is_read_itself_and_said_to_have_moved_on(monkeypatch):
    monkeypatch.setattr(lab.backend.tensorflow.feed, "COPY_LIMIT", 1000)  # the pipeline holds 1,408 bytes of arrays
    report = lab.inspect_data(shuffled_pipeline("shuffled", None), model=classifier())
    assert report.ok and report.batches_per_epoch == 4, report
    assert any("next order, not its first" in note for note in report.notes), report.notes
