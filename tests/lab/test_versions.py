"""The supported TensorFlow/Keras range is declared once and checked at import."""

import pytest

from lab import _versions


def test_versions_inside_the_range_pass():
    _versions.check_versions("2.16.2", "3.5.0")
    _versions.check_versions("2.21.0", "3.15.1")


@pytest.mark.parametrize(
    "tf_version, keras_version, named",
    [("2.15.1", "3.15.1", "tensorflow 2.15.1"), ("2.21.0", "2.15.0", "keras 2.15.0"), ("2.22.0", "3.16.0", "tensorflow 2.22.0")],
)
def test_versions_outside_the_range_name_installed_and_supported(tf_version, keras_version, named):
    with pytest.raises(ImportError) as error:
        _versions.check_versions(tf_version, keras_version)
    assert named in str(error.value)
    assert "supported" in str(error.value)


def test_another_backend_is_refused_with_the_fix():
    with pytest.raises(ImportError, match="TensorFlow or JAX backend.*'torch'.*KERAS_BACKEND='jax'"):
        _versions.check_backend("torch")
    _versions.check_backend("tensorflow")
    _versions.check_backend("jax")


def test_a_jax_out_of_range_names_jax_and_its_extra():
    with pytest.raises(ImportError, match=r"jax 0\.4\.1 is installed.*training-lab\[jax\]"):
        _versions.check_versions("0.4.1", "3.15.1", backend="jax")
    with pytest.raises(ImportError, match=r"keras 3\.8\.0 is installed; supported: keras>=3\.11"):
        _versions.check_versions("0.10.2", "3.8.0", backend="jax")
    _versions.check_versions("0.7.2", "3.11.0", backend="jax")


def test_pyproject_declares_the_same_range():
    import pathlib
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("=")[0].strip(): d for d in project["dependencies"]}
    assert not {"tensorflow", "jax", "torch"} & set(deps), "the core install pulls no backend"
    extras = project["optional-dependencies"]
    for backend, (package, (lo, hi)) in _versions.BACKEND_RANGES.items():
        assert f"{package}>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" in extras[backend]
    lo = _versions.KERAS_RANGES["jax"][0]
    assert f"keras>={lo[0]}.{lo[1]}" in extras["jax"]
    lo, hi = _versions.KERAS_RANGE
    assert deps["keras"] == f"keras>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
