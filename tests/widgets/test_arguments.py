"""Arguments of the views and the command: a wrong one fails at construction, naming itself and the fix."""

import keras
import numpy as np
import pytest

import lab
import widgets
from widgets import cli


def tiny_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


@pytest.mark.parametrize("arguments, error, message", [
    (dict(data=None), TypeError, r"Lab\(model, data\): data must be a tuple \(x, y\).*got NoneType.*widgets.Lab\(model, \(x_train"),
    (dict(data="digits"), TypeError, r"data must be a tuple.*got str"),
    (dict(data=(None, None)), ValueError, r"data's x is None"),
    (dict(model=3), TypeError, r"Lab\(model, data\): model must be a compiled keras.Model.*got int"),
    (dict(epochs="2"), TypeError, r"Lab\(epochs=...\) must be a whole number, 1 or more; got '2'"),
    (dict(epochs=0), ValueError, r"Lab\(epochs=...\)"),
    (dict(batch_size=2.5), TypeError, r"Lab\(batch_size=...\)"),
    (dict(breakpoints=3), TypeError, r"breakpoints must be a list of lab.Breakpoint"),
    (dict(build_model="mlp", model=None), TypeError, r"build_model=.*function"),
])
def test_lab_names_a_wrong_argument_at_construction(arguments, error, message):
    given = dict(model=tiny_model(), data=data())
    given.update(arguments)
    with pytest.raises(error, match=message):
        widgets.Lab(given.pop("model"), given.pop("data"), **given)


def test_lab_takes_a_plain_condition_as_a_breakpoint(comm_log):
    panel = widgets.Lab(tiny_model(), data(), breakpoints=lambda row: row["loss"] > 100)
    assert [type(p) for p in panel.breakpoints] == [lab.Breakpoint]


def test_mode_switch_names_a_wrong_argument_at_construction():
    with pytest.raises(TypeError, match=r"ModeSwitch\(model\): model must be a compiled keras.Model; got NoneType"):
        widgets.ModeSwitch(None)
    with pytest.raises(TypeError, match=r"ModeSwitch\(steps=...\) must be a whole number.*16\.0"):
        widgets.ModeSwitch(tiny_model(), steps=16.0)


def test_stepper_panel_names_a_wrong_argument_at_construction():
    with pytest.raises(TypeError, match=r"StepperPanel\(stepper\): stepper must be a lab.Stepper; got NoneType.*"
                                        r"widgets.StepperPanel\(lab.Stepper\(model"):
        widgets.StepperPanel(None)
    stepper = lab.Stepper(tiny_model(), data(), batch_size=8)
    with pytest.raises(TypeError, match=r"StepperPanel\(max_steps=...\) must be a whole number"):
        widgets.StepperPanel(stepper, max_steps="5")
    with pytest.raises(TypeError, match=r"on_continue=.*function"):
        widgets.StepperPanel(stepper, on_continue=3)


def test_demo_checks_out_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "demo", lambda **kwargs: pytest.fail("trained despite a bad --out"))
    a_file = tmp_path / "taken.txt"
    a_file.write_text("not a folder")
    for out, said in [(a_file, "is a file, not a folder"), (a_file / "sub", "is a file")]:
        with pytest.raises(SystemExit) as done:
            cli.main(["demo", "--out", str(out)])
        assert done.value.code == 2
        error = capsys.readouterr().err
        assert "argument --out" in error and said in error and str(a_file) in error


@pytest.mark.parametrize("argument, value", [("--batch-size", "abc"), ("--epochs", "2.5"), ("--epochs", "-1")])
def test_demo_says_what_a_number_must_be(capsys, argument, value):
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", argument, value])
    assert done.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {argument}: must be 1 or more, a whole number; got" in error
    assert "Traceback" not in error


def test_output_folder_makes_a_missing_folder(tmp_path):
    assert cli.output_folder(tmp_path / "new" / "demo") == str(tmp_path / "new" / "demo")
    assert (tmp_path / "new" / "demo").is_dir()
