"""lab.predict_stream on JAX: per-batch predictions equal model.predict's,
for arrays, a multi-input tuple, a PyDataset and a generator; the model
unchanged."""

import keras
import numpy as np
import pytest

import lab
from jax_models import classification_data, make_mlp, values


def test_streamed_predictions_equal_predict_and_leave_the_model_as_it_was():
    x, y = classification_data(n=100)
    model = make_mlp()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = values(model.weights)
    chunks = list(lab.predict_stream(model, x, batch_size=32))
    assert [len(c) for c in chunks] == [32, 32, 32, 4]
    np.testing.assert_allclose(np.concatenate(chunks), model.predict(x, batch_size=32, verbose=0), rtol=1e-6, atol=1e-6)
    for a, b in zip(before, values(model.weights)):
        np.testing.assert_array_equal(a, b)


def test_a_generator_a_pydataset_a_multi_input_tuple_and_collect():
    x, y = classification_data(n=64)
    model = make_mlp()
    expected = model.predict(x, batch_size=16, verbose=0)
    generated = np.concatenate(list(lab.predict_stream(model, ((x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)))))
    np.testing.assert_allclose(generated, expected, rtol=1e-6, atol=1e-6)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return x[index * 16:(index + 1) * 16]

    np.testing.assert_allclose(np.concatenate(list(lab.predict_stream(model, Batches()))), expected, rtol=1e-6,
                               atol=1e-6)
    a, b = keras.Input((3,)), keras.Input((5,))
    two = keras.Model([a, b], keras.layers.Dense(2)(keras.layers.Concatenate()([a, b])))
    left, right = np.ones((10, 3), "float32"), np.ones((10, 5), "float32")
    streamed = np.concatenate(list(lab.predict_stream(two, (left, right), batch_size=4)))
    np.testing.assert_allclose(streamed, two.predict((left, right), verbose=0), rtol=1e-6, atol=1e-6)
    seen = []
    assert lab.predict_stream(model, x, batch_size=16, collect=lambda y_pred, batch: seen.append(len(y_pred)),
                              steps=2) == 32
    assert seen == [16, 16]


def test_bad_arguments_are_refused_at_the_call():
    with pytest.raises(TypeError, match="needs a keras.Model"):
        lab.predict_stream(object(), np.zeros((2, 8)))
    with pytest.raises((TypeError, ValueError), match="batch_size"):
        lab.predict_stream(make_mlp(), np.zeros((2, 8)), batch_size=0)
