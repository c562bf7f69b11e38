"""Multi-replica and multi-worker training, each in fresh processes.

TensorFlow fixes its devices when it first uses them and the test process has
already done so, so every check that needs virtual CPUs or a cluster runs a
script from `_scripts/` in a subprocess and reads the JSON line it prints.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lab

SCRIPTS = Path(__file__).parent / "_scripts"


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def _result(stdout, stderr, returncode):
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert returncode == 0 and lines, f"script failed ({returncode}):\n{stderr[-3000:]}"
    return json.loads(lines[-1])


def run_script(name, *args, timeout=150):
    """Runs `_scripts/<name>` in a fresh Python and returns its JSON output."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True, text=True, timeout=timeout, env=_env(),
    )
    return _result(done.stdout, done.stderr, done.returncode)


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def mirrored():
    return run_script("mirrored_recorder.py", timeout=300)


def test_virtual_cpus_give_a_two_replica_mirrored_strategy(mirrored):
    assert mirrored["devices"] == [["/device:CPU:0", "CPU"], ["/device:CPU:1", "CPU"]]
    assert mirrored["mirrored_type"] == "MirroredStrategy"
    assert mirrored["replicas"] == 2
    assert mirrored["same_object"], "lab.strategy made a second strategy for the same devices"
    assert mirrored["cpu1"] == "OneDeviceStrategy"
    assert mirrored["split"] == [["CPU:0", 17], ["CPU:1", 16]]
    # As tf.distribute cuts a batch, a last batch of 1 included (it was refused).
    for described, cut in mirrored["split_against_tf"]:
        assert described == cut


def test_unavailable_devices_are_named_in_the_error(mirrored):
    assert "GPU:0" in mirrored["gpu_error"] and "CPU:0, CPU:1" in mirrored["gpu_error"]
    assert "CPU:2" in mirrored["cpu2_error"] and "virtual_cpus" in mirrored["cpu2_error"]


def test_virtual_cpus_after_initialisation(mirrored):
    assert mirrored["virtual_again"] is None, "repeating the same split must be allowed"
    assert "Restart the kernel" in mirrored["virtual_other"]
    assert "2 logical CPUs" in mirrored["virtual_other"]


def test_mirrored_recording_equals_one_device(mirrored):
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    from lab.backend.tensorflow.probes import KERAS_SCALES_LOSS

    if not KERAS_SCALES_LOSS:
        # The lab records what happens; what happens differs before Keras 3.7.
        pytest.skip("Keras before 3.7 sums the replicas' unscaled gradients: a mirrored "
                    "run does not follow the one-device trajectory")
    one, two = mirrored["one"], mirrored["mirrored"]
    assert set(one["columns"]) <= set(two["columns"])
    assert {"loss", "accuracy", "grad_norm"} <= set(two["columns"])
    assert len(two["columns"]["loss"]) == 4
    for column, values in one["columns"].items():
        np.testing.assert_allclose(two["columns"][column], values, rtol=1e-4, atol=1e-6,
                                   err_msg=column)
    for w1, w2 in zip(one["weights"], two["weights"]):
        np.testing.assert_allclose(w2, w1, rtol=1e-4, atol=1e-6)


def test_stepper_and_mode_switch_on_a_mirrored_model(mirrored):
    assert "tools_error" not in mirrored, mirrored["tools_error"]
    tools = mirrored["tools"]
    assert tools["step_error"] == "None" and tools["step_index"] == 0
    assert np.isfinite(tools["step_loss"]) and tools["step_gradients"] == 4
    assert tools["traces_after_rewind"] == 1
    # It steps on the replicas as fit() does (test_the_stepper_steps_a_mirrored_model_as_fit_does):
    # nothing to say. It said it stepped as one device, and weights parted from fit()'s.
    assert tools["replicas_told"] == [] and tools["replicas_events"] == []
    assert "XLA under MirroredStrategy" in tools["xla"]
    # An optimizer with slots (Adam) steps too: it failed, its slots made inside the step.
    assert tools["adam_step_error"] == "None" and tools["adam_slots"] > 2
    # Stepped inside the strategy's scope too (it failed there, stepping as one device).
    assert tools["in_scope_error"] == "None"
    # Gradient accumulation's update cannot leave a replica: that model steps as one device, and says so.
    assert len(tools["one_device_told"]) == 1 and "MirroredStrategy with 2 replicas" in tools["one_device_told"][0]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_the_stepper_steps_a_mirrored_model_as_fit_does(mirrored, mode):
    # It ran train_step on the whole batch, as one device: BatchNormalization's weights parted
    # from a mirrored fit()'s by 4e-3, and the stepper said so.
    assert "stepper_as_fit_error" not in mirrored, mirrored["stepper_as_fit_error"]
    stepped = mirrored["stepper_as_fit"][mode]
    assert stepped["errors"] == [] and stepped["told"] == []
    assert stepped["same_as_fit"] and all(stepped["same_as_fit"]), "each replica's copies equal fit()'s, bit for bit"
    assert stepped["replayed"]
    assert stepped["y_pred_rows"] == [16, 16, 9]  # the replicas' predictions, joined in batch order
    for column, (trace, recorded) in stepped["columns"].items():
        np.testing.assert_allclose(trace, recorded, rtol=1e-6, err_msg=column)


def test_the_stepper_steps_the_guides_gan_on_the_replicas_as_fit_does(mirrored):
    assert "stepper_gan_error" not in mirrored, mirrored["stepper_gan_error"]
    stepped = mirrored["stepper_gan"]
    assert stepped["errors"] == [] and stepped["told"] == []
    assert stepped["same_as_fit"] and stepped["replayed"]
    for column, (trace, recorded) in stepped["columns"].items():
        np.testing.assert_allclose(trace, recorded, rtol=1e-6, err_msg=column)


def test_an_interrupted_eager_step_on_the_replicas_is_undone_on_each(mirrored):
    # The replicas run an eager step in threads of their own, which go on past the Ctrl-C.
    assert "stepper_interrupted_error" not in mirrored, mirrored["stepper_interrupted_error"]
    assert mirrored["stepper_interrupted"] == {"interrupted": True, "undone": True, "next_error": "None",
                                               "as_fit": True, "threads_left": 0}


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_predict_stream_predicts_a_mirrored_model_as_model_predict_does(mirrored, mode):
    # It predicted on one device, with replica 0's moving statistics for every sample.
    assert "predicted_error" not in mirrored, mirrored["predicted_error"]
    predicted = mirrored["predicted"]
    assert predicted["replicas_differ"], "the check needs replicas whose moving statistics differ"
    assert predicted[mode]["same"], predicted[mode]


def test_compare_modes_puts_back_each_replicas_copy_of_a_mirrored_model(mirrored):
    # It put replica 0's BatchNormalization moving statistics on every replica.
    assert "compare_modes_error" not in mirrored, mirrored["compare_modes_error"]
    compared = mirrored["compare_modes"]
    assert compared["replicas_differ"], "the check needs replicas whose moving statistics differ"
    assert compared["unchanged"]


def test_stepper_rewind_puts_back_each_replicas_copy_of_a_mirrored_model(mirrored):
    # It put replica 0's BatchNormalization moving statistics on every replica:
    # the fit() after a rewind trained otherwise than a bare fit().
    assert "stepper_rewind_error" not in mirrored, mirrored["stepper_rewind_error"]
    assert mirrored["stepper_rewind"] == {"rewound": True, "replayed": True, "fit_after": True}


def test_eager_recording_on_a_mirrored_model(mirrored):
    assert "tools_error" not in mirrored, mirrored["tools_error"]
    tools = mirrored["tools"]
    assert "eager_error" not in tools, tools["eager_error"]
    assert len(tools["eager_grad_norms"]) == 4 and np.isfinite(tools["eager_grad_norms"]).all()


def test_nonfinite_breakpoint_on_one_replica_holds_every_replica(mirrored):
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    hit = mirrored["breakpoint"]
    assert hit["rows"] == 3 and [2, "nonfinite"] in hit["events"]
    assert hit["iterations"] == 2, "the update of the NaN batch must be skipped"
    assert hit["finite_weights"]
    # Each replica's moving statistics are put back too: they were left NaN
    # on the replica whose share held the NaN.
    assert len(hit["finite_statistics"]) == 4 and all(hit["finite_statistics"])


def test_the_guides_step_that_feeds_its_tracker_the_scaled_loss_is_told_so_not_blamed_on_compiled_metrics(mirrored):
    # Keras 3.8+ scales compute_loss's loss by 1/replicas: the guide's step
    # logs half the loss on two replicas. The lab said the step fed the
    # tracker predictions (compiled_metrics), and named the step's own form as the fix.
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    told = mirrored["guide_step"]
    assert told["unscaled"] == []
    if lab.compat.SCALES_LOSS_BY_REPLICAS:
        assert len(told["as_guide"]) == 1 and "divided by the 2 replicas" in told["as_guide"][0]
        assert "num_replicas_in_sync" in told["as_guide"][0] and "compiled_metrics" not in told["as_guide"][0]
    else:
        assert told["as_guide"] == []


def test_a_step_that_logs_its_loss_objects_scaled_value_is_told_and_its_rows_hold_the_batch_loss(mirrored):
    # keras-io's "going lower-level" step calls its own loss object, which
    # Keras 3.8+ scales by 1/replicas, and feeds that to its tracker: Keras
    # logs half the loss on two replicas. The lab recorded that half and said
    # nothing.
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    found = mirrored["lower_level"]
    one, as_guide, unscaled = found["one"], found["as_guide"], found["unscaled"]
    np.testing.assert_allclose(as_guide["rows"], one["rows"], rtol=1e-5)
    np.testing.assert_allclose(unscaled["rows"], one["rows"], rtol=1e-5)
    assert unscaled["warnings"] == [] and one["warnings"] == []
    if lab.compat.SCALES_LOSS_BY_REPLICAS:
        assert as_guide["history"][0] == pytest.approx(one["history"][0] / 2, rel=1e-5)  # Keras' own logs
        assert len(as_guide["warnings"]) == 1 and "1/2 of the batch's loss" in as_guide["warnings"][0]
        assert "num_replicas_in_sync" in as_guide["warnings"][0]
        assert any("scaled by 1/2" in detail for detail in as_guide["events"])
    else:
        assert as_guide["warnings"] == []
    assert not any("scaled" in detail for detail in unscaled["events"] + one["events"])
    assert found["keras_functions_back"], "the lab left its wrappers on Keras' loss scaling"


def test_gradients_are_recorded_with_breakpoints_on_a_mirrored_model(mirrored):
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    assert np.isfinite(mirrored["breakpoint"]["grad_norms"][:2]).all()


def test_mirrored_records_each_replica(mirrored):
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    columns = mirrored["mirrored"]["columns"]
    for replica, (loss, norm) in enumerate(mirrored["halves"]):
        assert columns[f"loss/replica_{replica}"][0] == pytest.approx(loss, rel=1e-4)
        assert columns[f"grad_norm/replica_{replica}"][0] == pytest.approx(norm, rel=1e-4)
    losses = np.array([columns["loss/replica_0"], columns["loss/replica_1"]])
    np.testing.assert_allclose(columns["replica_skew"], np.ptp(losses, axis=0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(columns["loss"], losses.mean(axis=0), rtol=1e-4)


def test_float8_training_on_the_replicas_records_each_replicas_gradient_norm_and_no_scale_columns(mirrored):
    assert "float8_error" not in mirrored, mirrored["float8_error"]
    found = mirrored["float8"]
    # The scales and amax histories the step sets have no gradient column,
    # and each replica's norm is its kernels' and biases' alone.
    assert found["set_apart"] == []
    np.testing.assert_allclose(found["recorded"], found["tape"], rtol=1e-4)


def test_a_batch_split_unevenly_over_the_replicas_records_its_samples_loss(mirrored):
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    uneven = mirrored["uneven"]
    # One sample on replica 0, none on replica 1: the batch's loss is that sample's
    # (it was the replicas' plain mean, half of it), as Keras' loss tracker weighs it.
    assert uneven["loss"] == pytest.approx(uneven["own"], rel=1e-6)
    assert uneven["replicas"][0] == pytest.approx(uneven["own"], rel=1e-6) and np.isnan(uneven["replicas"][1])
    assert uneven["skew"] == 0.0
    # Every row its batch's own loss: weighted by batch size they make the epoch's loss over
    # all 41 samples (Keras 3.15's History too; Keras 3.5 averages the replicas plainly).
    assert uneven["rows_weighted"] == pytest.approx(uneven["all_own"], rel=1e-5)


@pytest.mark.parametrize("loop", ["loop_mirrored", "loop_mirrored_eager", "loop_mirrored_in_scope",
                                  "loop_mirrored_in_scope_eager"])
def test_a_watched_loop_under_mirrored_strategy_records_what_one_device_records(mirrored, loop):
    # The tf.distribute guide's loop (strategy.run in a tf.function, and eager):
    # the applied gradients once, not each replica's write combined as several applies.
    # Inside `strategy.scope()` (keras-io's guide keeps everything there) the
    # block made its ring of rows a MirroredVariable, and the first step failed
    # with a bare NotImplementedError from the lab's write.
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    assert "loop_in_scope_error" not in mirrored, mirrored["loop_in_scope_error"]
    one, two = mirrored["loop_one"], mirrored[loop]
    assert two["columns"]["updated"] == [1.0] * 4
    assert {"loss", "grad_norm"} <= set(two["columns"]) and set(one["columns"]) == set(two["columns"])
    assert any(c.startswith("update_ratio/") for c in two["columns"])
    for column, values in one["columns"].items():
        np.testing.assert_allclose(two["columns"][column], values, rtol=1e-4, atol=1e-6, err_msg=column)
    for w1, w2 in zip(one["weights"], two["weights"]):
        np.testing.assert_allclose(w2, w1, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loop", ["loop_nonfinite", "loop_nonfinite_in_scope"])
def test_a_watched_loop_nonfinite_on_one_replica_skips_the_update_on_every_replica(mirrored, loop):
    assert "fit_error" not in mirrored, mirrored["fit_error"]
    assert "loop_in_scope_error" not in mirrored, mirrored["loop_in_scope_error"]
    loop = mirrored[loop]
    assert loop["hit"] == [2, "nonfinite", True]
    assert loop["columns"]["updated"] == [1.0, 1.0, 0.0]
    assert loop["iterations"] == 2 and loop["finite_weights"]


def test_two_workers_on_localhost(tmp_path):
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    run_path = tmp_path / "chief.h5"
    workers = []
    try:
        for index in range(2):
            config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            workers.append(subprocess.Popen(
                [sys.executable, str(SCRIPTS / "multiworker_worker.py"), str(run_path)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=_env(TF_CONFIG=config),
            ))
        outputs = [worker.communicate(timeout=150) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    chief, other = (_result(out, err, w.returncode) for (out, err), w in zip(outputs, workers))
    assert chief["replicas"] == 2
    for w1, w2 in zip(chief["weights"], other["weights"]):
        np.testing.assert_allclose(w2, w1, rtol=1e-5, atol=1e-6)
    run = lab.Run.load(run_path)
    batches = run.batches()
    assert len(batches) == 8 and list(batches["step"]) == list(range(8))
    assert np.isfinite(batches["loss"]).all() and np.isfinite(batches["grad_norm"]).all()
    assert len(run.epochs()) == 2


def test_a_first_batch_the_replicas_cannot_share_evenly_is_told_where_the_batch_size_is_given(mirrored):
    # Bare fit() fails on it before it trains, with TensorFlow's "AddN must have the same
    # size and shape"; the lab now says why and what to use where the batch size is given.
    assert "uneven_first_error" not in mirrored, mirrored["uneven_first_error"]
    told = mirrored["uneven_first"]
    assert "AddN" in told["fit_65"] and told["fit_64"] is None
    assert len(told["inspect_65"]) == 1 and told["inspect_64"] == []
    assert "33 on CPU:0, 32 on CPU:1" in told["inspect_65"][0] and "64 or 66" in told["inspect_65"][0]
    assert "fails on it before it trains" in told["picker_65"] and "64 or 66" in told["picker_65"]
    assert "fails" not in told["picker_64"]


def test_metrics_that_are_not_means_and_vector_metrics_on_the_replicas(mirrored):
    # The rows hold what Keras reports at each batch (one column per element of
    # F1Score's per-class vector), and the run says what that is on replicas:
    # the mean of each replica's own running value, not the value over all samples.
    assert "metrics_error" not in mirrored, mirrored["metrics_error"]
    got = mirrored["metrics"]
    np.testing.assert_allclose(got["f1"], got["keras_f1"], rtol=1e-6)
    np.testing.assert_allclose(got["rmse"], got["keras_rmse"], rtol=1e-6)
    assert got["running"] == ["f1/0", "f1/1", "f1/2", "rmse"]
    assert len(got["told"]) == 4 and all("On 2 replicas" in told for told in got["told"])


def test_the_distributed_training_guide_trains_watched_as_bare():
    # keras-io's "Multi-GPU distributed training with TensorFlow", its data
    # generated: the model made and compiled in MirroredStrategy's scope and
    # fit on Datasets with validation, then evaluated; then its fault
    # tolerance (a ModelCheckpoint each epoch, `make_or_restore_model`, a
    # second fit resumed from the checkpoint). Bare and with
    # Recorder(gradients=True, weights=True), each in a process of its own.
    runs = {}
    started = {kind: subprocess.Popen([sys.executable, str(SCRIPTS / "mirrored_guide.py"), kind], env=_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for kind in ("bare", "lab")}
    for kind, process in started.items():
        stdout, stderr = process.communicate(timeout=240)
        runs[kind] = _result(stdout, stderr, process.returncode)
    bare, watched = runs["bare"], runs["lab"]
    assert bare["replicas"] == 2
    recorded = watched.pop("recorded")
    assert watched == bare  # weights, optimizer state, History, evaluate(), the checkpoint and its restore
    assert [r["rows"] for r in recorded] == [24, 12, 12] and all(r["status"] == "finished" for r in recorded)
    assert all(r["finite"] and r["events"] == [] for r in recorded)
    columns = recorded[0]["columns"]
    assert [c for c in columns if "replica" in c] == ["grad_norm/replica_0", "grad_norm/replica_1"]
    assert len(columns) == 3 * 6 + 2  # each variable's gradient norm, weight norm and update ratio
    # The first row is the first batch's loss over both replicas' halves, as one device computes it.
    assert recorded[0]["loss"][0] == pytest.approx(bare["first_batch_loss"], rel=1e-5)
    assert recorded[1]["loss"][0] == pytest.approx(bare["first_batch_loss"], rel=1e-5)  # the guide's fresh model


def test_a_watched_step_that_meets_an_earlier_strategys_collective_keys_says_why_and_what_to_do():
    # Every MirroredStrategy made in a process starts its collective keys where
    # the first did (TensorFlow sets them apart in its own tests only), so the
    # guide's example run bare and then, on a new strategy, watched (whose step
    # has all-reduces of its own) fails with TensorFlow's "Shape mismatch in the
    # collective instance", which names neither cause nor fix. Bare fits of two
    # different models on two strategies fail the same way without the lab.
    done = subprocess.run([sys.executable, str(SCRIPTS / "mirrored_guide.py"), "made again"],
                          capture_output=True, text=True, timeout=150, env=_env())
    told = _result(done.stdout, done.stderr, done.returncode)
    assert "Shape mismatch in the collective instance" in told["error"]  # the user's error, raised as it was
    assert told["status"] == "failed"
    kind, detail = told["events"][-1]
    assert kind == "error" and detail.endswith(lab.compat.COLLECTIVE_KEYS_HINT)
    assert told["warnings"] == [lab.compat.COLLECTIVE_KEYS_HINT]
    assert "Restart the kernel" in told["warnings"][0] and 'lab.strategy(\"mirrored\")' in told["warnings"][0]


def test_a_watched_loop_that_meets_an_earlier_strategys_collective_keys_says_why_and_what_to_do():
    # The same in a `lab.watch` block: the guide's example bare, then a wider
    # model trained by the tf.distribute custom loop on a new strategy. The
    # error comes out of the user's own step; the block records and tells.
    done = subprocess.run([sys.executable, str(SCRIPTS / "mirrored_guide.py"), "loop made again"],
                          capture_output=True, text=True, timeout=150, env=_env())
    told = _result(done.stdout, done.stderr, done.returncode)
    assert "Shape mismatch in the collective instance" in told["error"]
    assert told["status"] == "failed"
    kind, detail = told["events"][-1]
    assert kind == "error" and lab.compat.COLLECTIVE_KEYS_HINT in detail
    assert told["warnings"] == [lab.compat.COLLECTIVE_KEYS_HINT]


def test_norms_every_on_the_replicas_takes_the_same_steps_norms_as_every_step(mirrored):
    assert "sampled_norms_error" not in mirrored, mirrored["sampled_norms_error"]
    every, sampled = mirrored["sampled_norms"]["every"], mirrored["sampled_norms"]["sampled"]
    assert sorted(every) == sorted(sampled) and any(c.startswith("update_ratio/") for c in sampled)
    for column, values in sampled.items():
        values = np.asarray(values)
        assert np.isfinite(values).tolist() == [True, False, True, False], column
        np.testing.assert_array_equal(values[::2], np.asarray(every[column])[::2], err_msg=column)
    for mine, theirs in zip(mirrored["sampled_norms"]["weights_sampled"], mirrored["sampled_norms"]["weights_every"]):
        np.testing.assert_array_equal(mine, theirs)
