"""Run files from anyone, after any crash: damaged, hostile and half-written files.

Loads of damaged and hostile files run in a subprocess that imports
lab/runfile.py alone (no TensorFlow), under an address-space cap
(RLIMIT_AS) and a timeout, so a load that hangs, crashes HDF5 or allocates
without bound fails the test instead of the test run.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pytest

import lab
from lab import runfile

SCRIPT = os.path.join(os.path.dirname(__file__), "_scripts", "run_files.py")
MEMORY_CAP_MB = 1024
ENVIRONMENT = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and kill -9: Linux")


def load_in_subprocess(paths, reference="-", timeout=120, opened_log=None):
    """{path: outcome row} for each file, loaded under the memory cap (with
    `opened_log`, under strace, which writes there every file the loader opens)."""
    command = [sys.executable, SCRIPT, "load", str(MEMORY_CAP_MB), str(reference), *map(str, paths)]
    if opened_log is not None:
        command = ["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(opened_log), *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENVIRONMENT)
    rows = {row["path"]: row for row in map(json.loads, done.stdout.splitlines())}
    missing = [str(p) for p in paths if str(p) not in rows]
    assert done.returncode == 0 and not missing, (
        f"the loader exited with {done.returncode} before {missing[:1]}: {done.stderr[-2000:]}")
    return rows


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real (small) run: fit() with a Recorder recording gradients, saved."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 3)).astype("float32"), rng.normal(size=(24, 1)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    recorder = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[recorder])
    recorder.run.add_event("note", "diverged here — ü")
    return recorder.run.save(tmp_path_factory.mktemp("recorded") / "run.h5")


def scripts():
    spec = importlib.util.spec_from_file_location("run_files", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("version, flips, smudges, cuts", [(2, 300, 100, 40), (1, 150, 50, 20)])
def test_bit_flips_and_truncations_load_equal_or_raise_naming_the_file(recorded, tmp_path, version, flips, smudges, cuts):
    if version == 1:  # as files were written before version 2: strings in HDF5's global heap
        recorded = scripts().save_version_1(lab.Run.load(recorded), tmp_path / "version-1.h5")
    content = open(recorded, "rb").read()
    rng = np.random.default_rng(14)
    offsets = sorted(set(np.linspace(0, len(content) - 1, flips - flips // 3).astype(int).tolist()
                         + rng.integers(0, len(content), flips // 3).tolist()))
    paths = []
    for offset in offsets:
        damaged = bytearray(content)
        damaged[offset] ^= int(rng.integers(1, 256))
        paths.append(tmp_path / f"flip-{offset}.h5")
        paths[-1].write_bytes(damaged)
    for k in range(smudges):  # several bytes overwritten at once, anywhere
        damaged = bytearray(content)
        for offset in rng.integers(0, len(content), int(rng.integers(2, 9))):
            damaged[offset] = int(rng.integers(0, 256))
        paths.append(tmp_path / f"smudge-{k}.h5")
        paths[-1].write_bytes(damaged)
    for length in sorted(set(np.linspace(0, len(content) - 1, cuts).astype(int).tolist())):
        paths.append(tmp_path / f"cut-{length}.h5")
        paths[-1].write_bytes(content[:length])

    rows = load_in_subprocess(paths, reference=recorded)

    # Version 2 files carry a digest: equal or refused. Version 1 files have
    # none, so a changed value can load as it is; but never a crash, a hang or
    # an error other than the run-file error.
    accepted = ("equal",) if version == 2 else ("equal", "loaded")
    wrong = [row for row in rows.values()
             if not (row["outcome"] in accepted
                     or row["outcome"] == "RunFileError" and row["path"] in row["message"])]
    assert not wrong, wrong[:5]
    assert all(rows[str(p)]["outcome"] == "RunFileError" for p in paths if p.name.startswith("cut-"))
    assert max(row["seconds"] for row in rows.values()) < 5
    # The same through lab.Run.load, in this process, for a sample.
    for path in paths[::60]:
        try:
            loaded = lab.Run.load(path)
        except lab.RunFileError as error:
            assert str(path) in str(error)
        else:
            assert version == 1 or loaded.batches().equals(lab.Run.load(recorded).batches())


def hostile_files(folder, base):
    """name -> path of files that try to read other files or exhaust memory."""
    secret = folder / "linked-target.h5"
    with h5py.File(secret, "w") as f:
        f["data"] = np.arange(4, dtype=np.float32)
    (folder / "linked-raw.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    made = {}

    def variant(name, change):
        path = folder / f"{name}.h5"
        path.write_bytes(open(base, "rb").read())
        with h5py.File(path, "a") as f:
            change(f)
        made[name] = path

    def replace_column(f, make):
        length = f["batches"].attrs["length"]
        del f["batches/c5"]
        make(f["batches"], length)

    def external_link(f):
        replace_column(f, lambda g, n: g.__setitem__("c5", h5py.ExternalLink(str(secret), "/data")))

    def external_link_elsewhere(f):
        f["notes"] = h5py.ExternalLink(str(secret), "/data")

    def soft_link_out(f):
        f["outside"] = h5py.ExternalLink(str(secret), "/")
        replace_column(f, lambda g, n: g.__setitem__("c5", h5py.SoftLink("/outside/data")))

    def virtual(f):
        layout = h5py.VirtualLayout(shape=(f["batches"].attrs["length"],), dtype=np.float32)
        layout[:4] = h5py.VirtualSource(str(secret), "data", shape=(4,))
        replace_column(f, lambda g, n: g.create_virtual_dataset("c5", layout, fillvalue=0))
        f["batches/c5"].attrs["kind"] = "float"

    def external_storage(f):
        replace_column(f, lambda g, n: g.create_dataset(
            "c5", shape=(n,), dtype=np.float32, external=[(str(folder / "linked-raw.bin"), 0, 4 * n)]))
        f["batches/c5"].attrs["kind"] = "float"

    def huge_rows(f):
        for table in ("batches",):
            f[table].attrs["length"] = 10**11
            for name in list(f[table]):
                kind = f[table][name].attrs.get("kind")
                del f[table][name]
                if kind is not None:
                    created = f[table].create_dataset(name, shape=(10**11,), dtype=np.float32, chunks=(1 << 16,))
                    created.attrs["kind"] = "float" if kind != "int" else "int"

    def huge_column(f):
        replace_column(f, lambda g, n: g.create_dataset("c5", shape=(10**11,), dtype=np.float32,
                                                         chunks=(1 << 16,)))
        f["batches/c5"].attrs["kind"] = "float"

    def huge_strings(f):
        f["events"].attrs["length"] = 10**11
        del f["events/c1"]
        created = f["events"].create_dataset("c1", shape=(10**11,), dtype=h5py.string_dtype(), chunks=(1 << 16,))
        created.attrs["kind"] = "string"

    def huge_length(f):
        f["events"].attrs["length"] = 10**11

    def plugin_filter(f):
        def make(group, n):
            plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            plist.set_chunk((max(1, n),))
            plist.set_filter(32001, h5py.h5z.FLAG_OPTIONAL, ())
            space = h5py.h5s.create_simple((n,))
            h5py.Dataset(h5py.h5d.create(group.id, b"c5", h5py.h5t.NATIVE_FLOAT, space, dcpl=plist))
        replace_column(f, make)
        f["batches/c5"].attrs["kind"] = "float"

    def deflate_bomb(f):
        replace_column(f, lambda g, n: g.create_dataset("c5", data=np.zeros(n, np.float32), compression="gzip"))
        f["batches/c5"].attrs["kind"] = "float"

    for name, change in [("external_link", external_link), ("external_link_elsewhere", external_link_elsewhere),
                         ("soft_link_out", soft_link_out), ("virtual", virtual),
                         ("external_storage", external_storage), ("huge_rows", huge_rows),
                         ("huge_column", huge_column), ("huge_strings", huge_strings), ("huge_length", huge_length),
                         ("plugin_filter", plugin_filter), ("deflate", deflate_bomb)]:
        variant(name, change)
    return made


EXPECTED = {
    "external_link": "external link", "external_link_elsewhere": "external link",
    "soft_link_out": "link", "virtual": "virtual dataset", "external_storage": "external file",
    "huge_rows": "declares 100000000000 values", "huge_length": "declares 100000000000 rows",
    "huge_column": "declares 100000000000 values", "huge_strings": "declares 100000000000 values", "plugin_filter": "filter 32001.*plugin", "deflate": "filter 1",
}


def test_links_virtual_datasets_huge_shapes_and_filters_are_refused_quickly_under_a_memory_cap(recorded, tmp_path):
    made = hostile_files(tmp_path, recorded)
    assert set(made) == set(EXPECTED)
    started = time.perf_counter()
    traced = shutil.which("strace") is not None and _strace_works(tmp_path)
    rows = load_in_subprocess(made.values(), opened_log=tmp_path / "opened.log" if traced else None)
    assert time.perf_counter() - started < 30
    if traced:  # the files they point at were never opened
        opened = (tmp_path / "opened.log").read_text()
        assert "linked-" not in opened, [line for line in opened.splitlines() if "linked-" in line][:3]
    for name, path in made.items():
        row = rows[str(path)]
        assert row["outcome"] == "RunFileError", (name, row)
        assert str(path) in row["message"]
        assert re.search(EXPECTED[name], row["message"]), (name, row["message"])
        assert row["seconds"] < 2, (name, row)
    # In this process too: the exported error.
    with pytest.raises(lab.RunFileError, match="external link"):
        lab.Run.load(made["external_link"])


def _strace_works(folder):
    # strace needs ptrace, which some containers forbid.
    try:
        done = subprocess.run(["strace", "-qq", "-o", str(folder / "probe.log"), sys.executable, "-c", "pass"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_a_kill_during_saves_keeps_the_target_and_the_next_save_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "run.h5"
    rng = np.random.default_rng(9)
    reference = None
    left_over = 0
    for _ in range(6):
        child = subprocess.Popen([sys.executable, SCRIPT, "save-forever", str(target), "20000"],
                                 stdout=subprocess.PIPE, text=True, env=ENVIRONMENT)
        try:
            assert child.stdout.readline().strip() == "saved"
            time.sleep(float(rng.uniform(0.0, 0.15)))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
        parts = runfile.load(target)  # intact: a whole file, not a half-written one
        assert len(parts.batches["step"]) == 20000
        reference = reference or parts
        assert parts.metadata == reference.metadata
        left_over += sum(name.endswith(".tmp") for name in os.listdir(tmp_path))
    lab.Run("next").save(tmp_path / "other.h5")
    assert sorted(os.listdir(tmp_path)) == ["other.h5", "run.h5"]
    assert left_over >= 1, "no kill landed inside a save: the cleanup went untested"
