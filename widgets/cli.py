"""The `training-lab` command: the lab's main job where no browser is at hand.

`training-lab demo` trains the quickstart model (a small MLP on the digits
bundled with scikit-learn; nothing is downloaded) with a `lab.Recorder`
recording gradients, then writes the run as HDF5 and an HTML report of its
charts, and prints where both are.
"""

import argparse
import os
import sys
import tempfile


def quickstart_model(seed=0):
    """The quickstart's model: a 64-32-10 MLP for the 8x8 digits, compiled.

    Args:
        seed: int, for reproducible initial weights.

    Returns:
        keras.Model, compiled with Adam, sparse cross-entropy and accuracy.
    """
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ], name="quickstart")
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def demo(epochs=5, out="training-lab-demo", batch_size=32, seed=0):
    """Trains the quickstart model with a Recorder and writes the run and its report.

    Args:
        epochs: int, training epochs (one takes about a second on a laptop CPU).
        out: str, the folder to write `run.h5` and `report.html` into.
        batch_size: int.
        seed: int.

    Returns:
        (run_path, report_path), the files written.

    Example:

    ```python
    run_path, report_path = demo(epochs=2, out="/tmp/demo")
    ```
    """
    import lab
    from widgets.report import write_report

    out = output_folder(out)
    (x, y), (x_test, y_test) = lab.datasets.digits()
    model = quickstart_model(seed)
    recorder = lab.Recorder(gradients=True)
    recorder.run.name = "quickstart"
    model.fit(x, y, epochs=epochs, batch_size=batch_size, validation_data=(x_test, y_test),
              callbacks=[recorder], verbose=0)
    run_path = recorder.run.save(os.path.join(out, "run.h5"))
    report_path = write_report(recorder.run, os.path.join(out, "report.html"),
                               title="Training Lab demo: quickstart MLP on digits")
    return os.path.abspath(run_path), os.path.abspath(report_path)


def output_folder(out):
    """Checks, before any training, that `out` is a folder the demo can write into.

    Creates it (and its parents) when missing.

    Args:
        out: str or os.PathLike, the folder for `run.h5` and `report.html`.

    Returns:
        str, the folder.

    Raises:
        NotADirectoryError: `out`, or a folder above it, is a regular file.
        PermissionError: the folder cannot be created or written.
    """
    out = os.fspath(out)
    if not out.strip():
        raise NotADirectoryError("the output folder is empty; give a folder, e.g. --out training-lab-demo")
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"{out!r} is a file, not a folder; give a folder for run.h5 and report.html")
    above = os.path.abspath(out)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise NotADirectoryError(f"cannot make the folder {out!r}: {above!r} is a file")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise PermissionError(f"cannot write into the folder {out!r} ({error.strerror or error}); "
                              "give a folder you can write to") from error
    return out


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 1 or more, a whole number; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, a whole number; got {value}")
    return value


def parser():
    """The command line of `training-lab`."""
    top = argparse.ArgumentParser(
        prog="training-lab",
        description="Watch and steer Keras 3 / TensorFlow training. In a notebook use "
                    "`widgets.Dashboard`; here, `training-lab demo` runs the quickstart headless.",
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    run_demo = commands.add_parser(
        "demo", help="train the quickstart model and write its run (HDF5) and an HTML report",
        description="Train the quickstart MLP on the bundled 8x8 digits with per-batch "
                    "recording and gradient norms, then write OUT/run.h5 (open it with "
                    "lab.Run.load) and OUT/report.html (charts, epochs, events; opens offline).",
    )
    run_demo.add_argument("--epochs", type=_positive, default=5, metavar="N",
                          help="training epochs (default: 5)")
    run_demo.add_argument("--out", default="training-lab-demo", metavar="DIR",
                          help="folder for run.h5 and report.html (default: ./training-lab-demo)")
    run_demo.add_argument("--batch-size", type=_positive, default=32, metavar="B",
                          help="batch size (default: 32)")
    return top


def main(argv=None):
    """Runs `training-lab` with `argv` (default: the process's arguments); returns the exit status."""
    command_line = parser()
    args = command_line.parse_args(argv)
    if args.command is None:
        command_line.print_help()
        return 2
    try:
        output_folder(args.out)  # before training: a bad --out fails in a second, not after it
    except OSError as error:
        command_line.error(f"argument --out: {error}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    run_path, report_path = demo(epochs=args.epochs, out=args.out, batch_size=args.batch_size)
    print(f"run:    {run_path}")
    print(f"report: {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
