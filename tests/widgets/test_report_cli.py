"""The HTML report and the `training-lab demo` command."""

import numpy as np
import pytest

import lab
from widgets import cli, report


def test_report_is_one_offline_page_with_charts_epochs_and_events(tmp_path, make_run):
    run = make_run(5000)
    run.metadata["optimizer"] = "Adam"
    run.append_epoch(0, {"loss": 0.9, "val_loss": 1.1})
    run.add_event("nonfinite", "grad_norm of m/out/kernel is inf", step=4200)
    path = report.write_report(run, tmp_path / "sub" / "report.html")
    page = open(path, encoding="utf-8").read()
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 4  # loss, metrics, gradient norms, heatmap
    assert "<script" not in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "val_loss" in page and "grad_norm of m/out/kernel is inf" in page and "Adam" in page
    assert len(page) < 200_000


def test_report_of_an_empty_run_says_so(tmp_path):
    page = report.report_html(lab.Run(name="empty"))
    assert "0 training steps" in page and "No finished epoch." in page and "No events." in page


def test_demo_writes_a_loadable_run_and_a_report(tmp_path, capsys):
    assert cli.main(["demo", "--epochs", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    run_path, report_path = tmp_path / "run.h5", tmp_path / "report.html"
    assert str(run_path) in out and str(report_path) in out
    run = lab.Run.load(run_path)
    batches = run.batches()
    assert len(batches) == 45  # 1,438 training digits in batches of 32
    assert np.isfinite(batches["loss"]).all()
    assert any(c.startswith("grad_norm/") for c in batches.columns)
    assert "val_accuracy" in run.epochs().columns
    page = report_path.read_text(encoding="utf-8")
    assert page.count("<svg") == 4 and "gradient norm per layer" in page


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--help"])
    assert done.value.code == 0
    assert "--epochs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--epochs", "0"])
    assert done.value.code == 2
    assert "must be 1 or more" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out
