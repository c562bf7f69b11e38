"""HDF5 files of a Run: atomic writes, validated reads, no pickles, no plugins.

Layout of a run file (format "training-lab-run", version 2):

- root attributes `format`, `version`, `name`, `metadata` (JSON),
  `written_by` (JSON: package versions of the writer) and `digest` (SHA-256
  over the name, the metadata and every table, as written). Text attributes
  are fixed-length UTF-8 strings;
- groups `batches`, `epochs` and `events`, one per table. A group's `columns`
  attribute (JSON) lists the column names in order and `length` the rows;
  column i is the dataset `c<i>`, whose `kind` attribute is `int`, `float`,
  `bool` or `string`. A string column's `c<i>` holds int64 codes into its
  distinct values (-1: missing), which are the UTF-8 bytes `u<i>` (uint8)
  cut at the offsets `o<i>` (int64, where each value ends). An `int`
  column of unsigned integers (training-lab writes none) is read as the
  signed type that holds its values, or refused when none does.

Nothing in a version 2 file is variable-length, so it has no HDF5 global
heap and every size in it is bounded by the file's own. Version 1 files
(variable-length strings, a boolean mask `m<i>` of missing strings, no
digest required) are still read.

Metadata is stored as JSON: tuples come back as lists and values JSON cannot
hold come back as their `str()`.

Run files are shared, so `load` trusts nothing in them. Before any data is
read it refuses links of every kind but hard links (an external link or a
virtual dataset would read another file), datasets whose raw data lives in
other files, filters (run files use none; a plugin filter would load a shared
library, a compressed one could inflate without bound) and declared sizes the
file cannot hold. Everything read is checked against the digest, so a damaged
file raises `RunFileError` instead of loading different numbers. A table
with rows lacking a column every run writes (`step`; an epoch's `epoch`; an
event's `kind`, `detail` and `time`), an event's `kind` or `detail` that is
not text or its `time` not a time, or a step beyond 2**53 either way, is
refused too: what reads a run relies on them.

This module reads and writes plain parts (`RunParts`); `lab.Run.save` and
`lab.Run.load` turn them into a Run.
"""

import collections
import contextlib
import hashlib
import importlib.metadata
import json
import mmap
import os
import re
import secrets
import socket
import threading
import time

import numpy as np
import pandas as pd

FORMAT = "training-lab-run"
VERSION = 2
_TABLES = ("batches", "epochs", "events")
_KINDS = ("int", "float", "bool", "string")
_INTEGER_COLUMNS = ("step", "epoch", "batch")
# The columns every row of a table has had since the first run file: lab.compare,
# the exports and the widgets read them from any run with rows.
_REQUIRED_COLUMNS = {"batches": ("step",), "epochs": ("epoch", "step"),
                     "events": ("step", "kind", "detail", "time")}
# What an event's columns hold (its `step` is an integer column): the views and
# the report read them as text and as a time.time() to show as a local time.
_EVENT_COLUMN_KINDS = {"kind": ("string",), "detail": ("string",), "time": ("float", "int")}
# Past any real run, and steps stay exact as floats (how pandas holds a column
# with missing values); a step near 2**63 would make the next one overflow.
# `lab.Run` refuses steps beyond it, so it never saves a file this refuses.
MAX_STEP = 2**53
# More links than any run could need (a column and its mask per name): a
# damaged group that claims millions of members is refused, not walked.
_MAX_MEMBERS = 200_000
# What one read of string cells may decode at most: each cell can point at a
# string as long as the file, so reads of long columns go in blocks.
_STRING_BLOCK_BYTES = 1 << 30
# Temporary files of crashed saves older than this, from before temporary
# names carried their writer's process id, are removed by the next save.
_LEGACY_TEMPORARY_AGE = 3600.0

RunParts = collections.namedtuple("RunParts", ["name", "metadata", "batches", "epochs", "events"])
RunParts.__doc__ = """What a run file holds, as plain data.

`batches` is a dict of column name -> 1-D numpy array (all of one length);
`epochs` and `events` are lists of dicts of plain Python values.
"""


class RunFileError(ValueError):
    """A file that is not a readable run record: damaged, foreign or unsafe.

    The message names the file and what is wrong with it.
    """


def _h5py():
    import h5py

    return h5py


@contextlib.contextmanager
def _no_plugins(h5py):
    """Empties HDF5's plugin search path while a run file is open.

    HDF5 loads filter plugins (shared libraries) from this path when a dataset
    names a filter it lacks; a run file never needs one. The path is global,
    so it is restored afterwards for the user's other HDF5 files.
    """
    saved = [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())]
    for _ in saved:
        h5py.h5pl.remove(0)
    try:
        yield
    finally:
        for _ in range(h5py.h5pl.size()):
            h5py.h5pl.remove(0)
        for entry in saved:
            h5py.h5pl.append(entry)


# ---- saving -------------------------------------------------------------------

_writing = set()  # temporary files this process is writing now
_writing_lock = threading.Lock()


def save(run, path):
    """Writes `run` to `path` (HDF5) through a temporary file and a rename.

    A crash, a kill or an interrupt during the write leaves any previous file
    at `path` intact. A save that was killed leaves its temporary file (a
    hidden `.run-*.h5.tmp` beside `path`); the next save into that folder
    removes every such file whose writer is no longer running.

    Args:
        run: `lab.Run` (or anything with `name`, `metadata`, `batches()`,
            `epochs()` and `events()`), the record to write.
        path: str or os.PathLike, the file to (over)write.

    Returns:
        str, the path written.

    Raises:
        TypeError: `path` is not a path.
        ValueError: `path` is empty.
        IsADirectoryError, NotADirectoryError, PermissionError: `path` names a
            folder, lies under a regular file, or cannot be written; the
            message says which.

    Example:

    ```python
    lab.runfile.save(recorder.run, "runs/lr-0.01.h5")
    ```
    """
    h5py = _h5py()
    given = path
    path = _checked_target(path)
    folder = os.path.dirname(path)
    remove_stale_temporaries(folder)
    temporary = os.path.join(folder, _temporary_name())
    try:
        # 0o666 less the umask: the permissions a plainly created file gets.
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except PermissionError as error:
        raise PermissionError(
            f"Cannot save the run to {path!r}: no permission to write in the folder {folder!r}."
        ) from error
    with _writing_lock:
        _writing.add(temporary)
    try:
        digest = hashlib.sha256()
        name = str(run.name)
        metadata = json.dumps(run.metadata, default=str)
        _digest_header(digest, name, metadata)
        with h5py.File(temporary, "w") as f:
            _set_text(f, "format", FORMAT, h5py)
            f.attrs["version"] = VERSION
            _set_text(f, "name", name, h5py)
            _set_text(f, "metadata", metadata, h5py)
            _set_text(f, "written_by", json.dumps(_writer_versions()), h5py)
            for table in _TABLES:
                _write_table(f.create_group(table), getattr(run, table)(), h5py, digest)
            _set_text(f, "digest", digest.hexdigest(), h5py)
        # The rename must not reach the disk before the data it points at.
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
        _sync_folder(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    finally:
        with _writing_lock:
            _writing.discard(temporary)
    return os.fspath(given)


def _checked_target(path):
    """The absolute file path to save to, or an error that says what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"run.save(path) needs a file path (str or os.PathLike); got {type(path).__name__}.")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise ValueError("run.save(path) needs a file name, e.g. run.save('runs/run.h5'); got an empty path.")
    absolute = os.path.abspath(text)
    if text.endswith(("/", os.sep)) or os.path.isdir(absolute):
        raise IsADirectoryError(
            f"Cannot save the run to {text!r}: it is a folder. Give a file name in it, "
            f"e.g. {os.path.join(text, 'run.h5')!r}.")
    folder = os.path.dirname(absolute)
    ancestor = folder
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise NotADirectoryError(
            f"Cannot save the run to {text!r}: {ancestor!r} is a file, not a folder.")
    try:
        os.makedirs(folder, exist_ok=True)
    except PermissionError as error:
        raise PermissionError(
            f"Cannot save the run to {text!r}: no permission to create the folder {folder!r}.") from error
    return absolute


def _sync_folder(folder):
    # Makes the rename itself durable; not every platform can open a folder.
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


_HOST = hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]
_TEMPORARY = re.compile(r"^\.run-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{8}\.h5\.tmp$")
_LEGACY_TEMPORARY = re.compile(r"^\.run-[A-Za-z0-9_]{8}\.h5\.tmp$")  # tempfile.mkstemp's names


def _temporary_name():
    # The writer's host and process id are in the name so that a later save
    # can tell a crashed save's leftover from a save still under way.
    return f".run-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.h5.tmp"


def remove_stale_temporaries(folder):
    """Removes the temporary files of saves into `folder` that crashed or were killed.

    Only files named as `save` names its temporary files are considered, and
    only those whose writer, a process on this host, is no longer running (or
    that an older training-lab left over an hour ago).

    Args:
        folder: str, the folder to tidy.

    Returns:
        list of str, the files removed.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _TEMPORARY.match(name)
        full = os.path.join(folder, name)
        if match:
            if match["host"] != _HOST or _writer_alive(int(match["pid"]), full):
                continue
        elif _LEGACY_TEMPORARY.match(name):
            with contextlib.suppress(OSError):
                if time.time() - os.stat(full).st_mtime < _LEGACY_TEMPORARY_AGE:
                    continue
        else:
            continue
        with contextlib.suppress(OSError):
            os.remove(full)
            removed.append(full)
    return removed


def _writer_alive(pid, temporary):
    if os.name != "posix":
        return True  # no cheap, safe liveness test: leave the file
    if pid == os.getpid():
        with _writing_lock:
            return temporary in _writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")  # a killed writer not yet reaped is a zombie


def _writer_versions():
    import h5py

    try:
        own = importlib.metadata.version("training-lab")
    except importlib.metadata.PackageNotFoundError:
        own = "unknown"
    return {"training-lab": own, "h5py": h5py.__version__,
            "numpy": np.__version__, "pandas": pd.__version__}


def _set_text(obj, key, text, h5py):
    """A fixed-length UTF-8 string attribute (variable-length ones live in the global heap)."""
    data = text.encode("utf-8", "surrogatepass")
    obj.attrs.create(key, data=np.array(data, dtype=f"S{max(1, len(data))}"),
                     dtype=h5py.string_dtype("utf-8", max(1, len(data))))


def _write_table(group, frame, h5py, digest=None):
    columns = [str(c) for c in frame.columns]
    _set_text(group, "columns", json.dumps(columns), h5py)
    group.attrs["length"] = len(frame)
    if digest is not None:
        _digest_table(digest, group.name, columns, len(frame))
    for i, name in enumerate(frame.columns):
        values = frame[name]
        kind = _kind(values)
        if kind == "string":
            missing = values.isna().to_numpy(dtype=bool)
            cells = np.array([None if gone else str(v) for v, gone in zip(values, missing)], dtype=object)
            codes, distinct = pd.factorize(cells, use_na_sentinel=True)
            codes = codes.astype(np.int64)
            encoded = [value.encode("utf-8", "surrogatepass") for value in distinct]
            ends = np.cumsum([len(b) for b in encoded], dtype=np.int64)
            dataset = group.create_dataset(f"c{i}", data=codes)
            group.create_dataset(f"u{i}", data=np.frombuffer(b"".join(encoded), dtype=np.uint8))
            group.create_dataset(f"o{i}", data=ends)
            if digest is not None:
                _digest_coded_strings(digest, codes, list(distinct))
        else:
            array = values.to_numpy()
            dataset = group.create_dataset(f"c{i}", data=array)
            if digest is not None:
                _digest_numbers(digest, kind, array)
        _set_text(dataset, "kind", kind, h5py)


def _kind(values):
    dtype = values.dtype
    if pd.api.types.is_bool_dtype(dtype):
        return "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "int"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    return "string"


# ---- the digest: the same bytes from what is written and from what is read ------

def _digest_header(digest, name, metadata):
    for part in (FORMAT, name, metadata):
        _digest_bytes(digest, part.encode("utf-8", "surrogatepass"))


def _digest_table(digest, table, columns, length):
    _digest_bytes(digest, json.dumps([table.strip("/"), columns, int(length)]).encode())


def _digest_numbers(digest, kind, array):
    array = np.ascontiguousarray(array)
    _digest_bytes(digest, f"{kind}:{array.dtype.kind}{array.dtype.itemsize}".encode())
    _digest_bytes(digest, array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def _digest_strings(digest, text, missing):
    cells = [None if gone else value for value, gone in zip(text, missing)]
    _digest_bytes(digest, b"string")
    _digest_bytes(digest, json.dumps(cells, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _digest_coded_strings(digest, codes, distinct):
    _digest_bytes(digest, b"coded strings")
    _digest_bytes(digest, np.ascontiguousarray(codes, dtype="<i8").tobytes())
    _digest_bytes(digest, json.dumps(distinct, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _digest_bytes(digest, data):
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


# ---- loading ------------------------------------------------------------------

def load(path):
    """Reads the parts of a run written by `save`, trusting nothing in the file.

    Args:
        path: str or os.PathLike, a file written by `Run.save`.

    Returns:
        `RunParts`: `name`, `metadata`, `batches` (dict of column arrays),
        `epochs` and `events` (lists of row dicts). `lab.Run.load(path)` makes
        a Run of them.

    Raises:
        RunFileError: the file is missing, truncated, damaged, not a run
            record, or holds what a run file never does (links to other files,
            virtual datasets, filters, sizes beyond the file's own); the
            message names the file and what is wrong.

    Example:

    ```python
    parts = lab.runfile.load("runs/lr-0.01.h5")
    ```
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Run.load(path) needs a file path (str or os.PathLike); got {type(path).__name__}.")
    path = os.fsdecode(os.fspath(path))
    if not os.path.isfile(path):
        raise RunFileError(f"No run file at {path!r}: it does not exist or is not a file.")
    h5py = _h5py()
    size = os.path.getsize(path)
    with _no_plugins(h5py):
        try:
            f = h5py.File(path, "r", locking=False)
        except Exception as error:  # noqa: BLE001 - any failure to open is a bad file
            raise RunFileError(
                f"{path!r} is not a readable HDF5 file (truncated, or another format): {error}. "
                "Run files are written by `run.save(path)` or `lab.Recorder(path=...)`."
            ) from None
        try:
            with f:
                return _read(f, _Reader(path, size, h5py))
        except RunFileError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a damaged file makes h5py raise
            raise RunFileError(
                f"{path!r} is a damaged or incomplete run file ({type(error).__name__}: {error})."
            ) from None


class _Reader:
    def __init__(self, path, size, h5py):
        self.path, self.size, self.h5py = path, size, h5py
        self.largest_string = size or 1  # the largest object in the file's global heaps, once walked
        self.version = 1

    def fail(self, problem):
        raise RunFileError(f"{self.path!r}: {problem}")

    def attribute(self, obj, name, where, kinds):
        """A scalar attribute, checked for size and type before it is read."""
        h5py = self.h5py
        if name not in obj.attrs:
            self.fail(f"{where} has no {name!r} attribute; the file is damaged or not a run record.")
        attribute = h5py.h5a.open(obj.id, name.encode())
        if attribute.shape not in ((), (1,)) or attribute.get_storage_size() > self.size:
            self.fail(f"the {name!r} attribute of {where} is not a single value; the file is damaged.")
        wanted = " or ".join({"str": "a string", "int": "an integer"}[k] for k in kinds)
        datatype = attribute.get_type()
        if not any(self.stored_as(datatype, kind) for kind in kinds):
            shown = _described(datatype, h5py)
            if self.stored_as(datatype, "str"):
                shown = _shown(_plain(obj.attrs[name]))  # a plain string is safe to read and show
            self.fail(f"the {name!r} attribute of {where} is {shown}, not {wanted}; the file is damaged.")
        value = _plain(obj.attrs[name])
        if "str" in kinds and isinstance(value, str):
            return value
        if "int" in kinds and isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        self.fail(f"the {name!r} attribute of {where} is {_shown(value)}, not {wanted}; the file is damaged.")

    def stored_as(self, datatype, kind):
        """Whether an HDF5 datatype is one a run file stores `kind` as.

        Checked before a value is read: HDF5 converts what a damaged datatype
        message says (a string whose flags turned it into a variable-length
        sequence crashes the conversion), so only the plain types pass.
        """
        t = self.h5py.h5t
        if kind in ("str", "string"):
            return (isinstance(datatype, t.TypeStringID)
                    and datatype.get_cset() in (t.CSET_ASCII, t.CSET_UTF8)
                    and datatype.get_strpad() in (t.STR_NULLTERM, t.STR_NULLPAD, t.STR_SPACEPAD)
                    and (datatype.is_variable_str() or 0 < datatype.get_size() <= self.size))
        if kind == "int":
            return isinstance(datatype, t.TypeIntegerID) and datatype.get_size() in (1, 2, 4, 8)
        if kind == "float":
            return isinstance(datatype, t.TypeFloatID) and datatype.get_size() in (2, 4, 8)
        if kind == "bool":
            return (isinstance(datatype, t.TypeEnumID) and datatype.get_size() == 1
                    and datatype.get_nmembers() == 2)
        return False

    def json_attribute(self, obj, name, where, expected_type, described):
        text = self.attribute(obj, name, where, ("str",))
        try:
            value = json.loads(text)
        except ValueError:
            self.fail(f"the {name!r} attribute of {where} is not valid JSON; the file is damaged.")
        if not isinstance(value, expected_type):
            self.fail(f"the {name!r} attribute of {where} is {text[:80]!r}, not {described}; "
                      "the file is damaged.")
        return value


def _plain(value):
    if isinstance(value, np.ndarray) and value.shape == (1,):
        value = value[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    return value


def _shown(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _described(datatype, h5py):
    t = h5py.h5t
    for kind, words in ((t.TypeStringID, "a string"), (t.TypeIntegerID, "an integer"),
                        (t.TypeFloatID, "a floating-point number"), (t.TypeEnumID, "an enumeration"),
                        (t.TypeVlenID, "a variable-length sequence"), (t.TypeCompoundID, "a compound value")):
        if isinstance(datatype, kind):
            return words
    return f"of HDF5 type class {datatype.get_class()}"


def _read(f, reader):
    _check_global_heaps(f, reader)
    _check_header(f, reader)
    _check_structure(f, reader)
    name = reader.attribute(f, "name", "the file", ("str",))
    metadata_text = reader.attribute(f, "metadata", "the file", ("str",))
    metadata = reader.json_attribute(f, "metadata", "the file", dict, "a JSON object")
    # Version 1 files were written before the digest (or with it, since this
    # reader); from version 2 on a file without one is damaged.
    expected = None
    if "digest" in f.attrs or reader.version >= 2:
        expected = reader.attribute(f, "digest", "the file", ("str",))
    digest = hashlib.sha256()
    _digest_header(digest, name, metadata_text)
    tables = {}
    for table in _TABLES:
        if table not in f or not isinstance(f[table], reader.h5py.Group):
            reader.fail(f"it has no {table!r} table; the file is damaged or incomplete.")
        tables[table] = _read_table(f[table], table, reader, digest)
    if expected is not None and digest.hexdigest() != expected:
        reader.fail("its contents do not match the digest written with them; the file is damaged.")
    return RunParts(name, metadata, tables["batches"], _records(tables["epochs"]), _records(tables["events"]))


def _check_global_heaps(f, reader):
    """Refuses global heap collections whose objects do not tile them.

    Variable-length strings live in HDF5's global heap. HDF5 1.14 decodes a
    collection by stepping from object to object by their declared sizes and
    loops forever (in `H5HG__cache_heap_deserialize`) when a damaged size makes
    a step zero, or runs outside the collection when a step overshoots. No
    h5py call can look at a collection before HDF5 decodes it, so every
    collection in the file (it begins with `GCOL`, version 1, and is at least
    4096 bytes) is walked here first, the way HDF5 walks it.
    """
    length_size = f.id.get_create_plist().get_sizes()[1]
    header = 8 + length_size
    largest = 1
    with open(reader.path, "rb") as file:
        if not reader.size:
            return
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            at = view.find(b"GCOL")
            while at != -1:
                size = int.from_bytes(view[at + 8:at + 8 + length_size], "little")
                end = at + size
                if view[at + 4:at + 8] == b"\x01\0\0\0" and header <= size and end <= len(view):
                    p = at + header
                    while p + header <= end:
                        index = int.from_bytes(view[p:p + 2], "little")
                        declared = int.from_bytes(view[p + 8:p + 8 + length_size], "little")
                        step = declared if index == 0 else header + ((declared + 7) & ~7)
                        step %= 1 << 64  # size_t arithmetic, as in HDF5
                        if step == 0 or step > end - p:
                            reader.fail(f"its global heap (the variable-length strings) at byte {at} is "
                                        "damaged: an object's size does not fit the heap.")
                        if index:
                            largest = max(largest, declared)
                        p += step
                at = view.find(b"GCOL", at + 1)
    reader.largest_string = largest


def _check_header(f, reader):
    found = reader.attribute(f, "format", "the file", ("str", "int")) if "format" in f.attrs else None
    if found != FORMAT:
        reader.fail(f"it is an HDF5 file but not a training-lab run record "
                    f"(its `format` attribute is {found!r}, expected {FORMAT!r}).")
    version = reader.attribute(f, "version", "the file", ("int",))
    if version > VERSION:
        reader.fail(f"it was written by a newer training-lab (run file version {version}; "
                    f"this one reads up to {VERSION}). Upgrade training-lab.")
    if version < 1:
        reader.fail(f"its run file version is {version}; versions start at 1. The file is damaged.")
    reader.version = version


def _check_structure(f, reader):
    """Refuses, before any data is read, what could read other files or exhaust memory."""
    h5py = reader.h5py
    count = 0
    pending = [(f, 0)]
    while pending:
        group, depth = pending.pop()
        for member in group:
            count += 1
            if count > _MAX_MEMBERS:
                reader.fail(f"it holds more than {_MAX_MEMBERS} objects; the file is damaged or not a run record.")
            where = f"{group.name.rstrip('/')}/{member}"
            link = group.get(member, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                reader.fail(f"{where!r} is an external link (to {link.filename!r}); run files never "
                            "link to other files, and it is not followed.")
            if isinstance(link, h5py.SoftLink):
                reader.fail(f"{where!r} is a soft link (to {link.path!r}); run files hold none, and it "
                            "is not followed.")
            if not isinstance(link, h5py.HardLink):
                reader.fail(f"{where!r} is a link of an unknown kind; it is not followed.")
            obj = group[member]
            if isinstance(obj, h5py.Group):
                if depth >= 1:
                    reader.fail(f"{where!r} is a group nested deeper than run files nest; "
                                "the file is not a run record.")
                pending.append((obj, depth + 1))
            elif isinstance(obj, h5py.Dataset):
                _check_dataset(obj, where, reader)


def _check_dataset(dataset, where, reader):
    h5py = reader.h5py
    plist = dataset.id.get_create_plist()
    layout = plist.get_layout()
    if layout == h5py.h5d.VIRTUAL or dataset.is_virtual:
        reader.fail(f"{where!r} is a virtual dataset (its data would come from other files); "
                    "run files hold none.")
    if plist.get_external_count():
        reader.fail(f"{where!r} keeps its data in an external file; run files keep all data inside.")
    if layout not in (h5py.h5d.COMPACT, h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED):
        reader.fail(f"{where!r} has an unknown storage layout ({layout}).")
    for k in range(plist.get_nfilters()):
        code = plist.get_filter(k)[0]
        if code >= 256:
            # Ids below 256 are HDF5's own; others come from plugins (shared libraries).
            reader.fail(f"{where!r} needs HDF5 filter {code}, which only a plugin provides; run files "
                        "use none and plugins are never loaded.")
        reader.fail(f"{where!r} uses HDF5 filter {code} (compression or checksums); run files are "
                    "written without filters, so this one was not written by training-lab.")
    if dataset.ndim != 1:
        reader.fail(f"{where!r} has shape {dataset.shape}; run file columns are 1-D.")
    declared = int(dataset.shape[0]) * max(1, dataset.id.get_type().get_size())
    if declared > reader.size:
        reader.fail(f"{where!r} declares {dataset.shape[0]} values ({declared} bytes), more than the "
                    f"file's {reader.size} bytes can hold; the file is damaged.")


def _read_table(group, table, reader, digest):
    h5py = reader.h5py
    where = f"table {table!r}"
    columns = reader.json_attribute(group, "columns", where, list, "a JSON list of column names")
    if not all(isinstance(c, str) for c in columns) or len(set(columns)) != len(columns):
        reader.fail(f"the columns of {where} are not distinct names; the file is damaged.")
    length = reader.attribute(group, "length", where, ("int",))
    if length < 0 or length > reader.size or (length and not columns):
        reader.fail(f"{where} declares {length} rows, which its {len(columns)} columns in a file of "
                    f"{reader.size} bytes cannot hold; the file is damaged.")
    missing = [repr(c) for c in _REQUIRED_COLUMNS[table] if c not in columns]
    if length and missing:
        rows = "row" if length == 1 else "rows"
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} or {missing[-1]}"
        reader.fail(f"{where} has {length} {rows} but no {names} column; every run writes "
                    f"{'it' if len(missing) == 1 else 'them'}, so the file is damaged or not written "
                    "by training-lab.")
    _digest_table(digest, group.name, columns, length)
    data = {}
    for i, name in enumerate(columns):
        column = f"column {name!r} of {where}"
        dataset = group.get(f"c{i}")
        if not isinstance(dataset, h5py.Dataset):
            reader.fail(f"{column} is missing; the file is damaged or incomplete.")
        if dataset.shape != (length,):
            reader.fail(f"{column} has shape {dataset.shape}, expected ({length},); the file is damaged.")
        kind = reader.attribute(dataset, "kind", column, ("str",))
        if kind not in _KINDS:
            reader.fail(f"{column} has unknown kind {kind!r}.")
        if name in _INTEGER_COLUMNS and kind != "int" and length:
            reader.fail(f"{column} holds {kind} values; {name!r} counts and holds integers. "
                        "The file is damaged.")
        if table == "epochs" and length and kind == "string":
            reader.fail(f"{column} holds text; an epoch's values are numbers (Keras' epoch logs). "
                        "The file is damaged or not written by training-lab.")
        if table == "events" and length and kind not in _EVENT_COLUMN_KINDS.get(name, (kind,)):
            reader.fail(f"{column} holds {kind} values; an event's {name!r} is "
                        f"{'a time in seconds' if name == 'time' else 'text'}. The file is damaged.")
        stored = "int" if kind == "string" and reader.version >= 2 else kind
        if not reader.stored_as(dataset.id.get_type(), stored):
            reader.fail(f"{column} is marked {kind} but stored as another type; the file is damaged.")
        if kind == "string" and reader.version >= 2:
            codes, distinct = _read_coded_strings(group, i, dataset, length, column, reader)
            _digest_coded_strings(digest, codes, distinct)
            values = np.array(distinct + [None], dtype=object)[codes]  # code -1: the None at the end
        elif kind == "string":
            values, missing = _read_strings(group, i, dataset, length, column, reader)
            _digest_strings(digest, values, missing)
            values = np.array(values, dtype=object) if length else np.empty(0, object)
            values[missing] = None
        else:
            wanted = {"int": "iu", "float": "f", "bool": "b"}[kind]
            if dataset.dtype.kind not in wanted:
                reader.fail(f"{column} is marked {kind} but holds {dataset.dtype}; the file is damaged.")
            values = dataset[()]
            _digest_numbers(digest, kind, values)
            if values.dtype.kind == "u":
                values = _signed(values, column, reader)
            if name == "step" and length and not -MAX_STEP <= values.min() <= values.max() <= MAX_STEP:
                absurd = values.max() if values.max() > MAX_STEP else values.min()
                reader.fail(f"{column} holds step {int(absurd)}; no run takes 2**53 steps (the next "
                            "step could overflow). The file is damaged.")
        if table == "events" and length and name in _EVENT_COLUMN_KINDS:
            _check_event_column(name, values, column, reader)
        data[name] = values
    return data


def _check_event_column(name, values, column, reader):
    """Refuses missing text and times that are no time (`Run.add_event` writes neither)."""
    if name != "time":
        if any(value is None for value in values):
            reader.fail(f"{column} has missing values; every event has its {name}. The file is damaged.")
        return
    for value in (values.min(), values.max()):
        try:
            time.localtime(float(value))
        except (OverflowError, ValueError, OSError):
            reader.fail(f"{column} holds {float(value)!r}, not a time; the file is damaged.")


def _signed(values, column, reader):
    """Unsigned integers (which lab never writes) as the signed type that holds them.

    A Run marks missing integers with -1, which no unsigned type holds.
    """
    if values.dtype.itemsize < 8:
        return values.astype(f"i{2 * values.dtype.itemsize}")
    if len(values) and values.max() > np.iinfo(np.int64).max:
        reader.fail(f"{column} holds {int(values.max())}, beyond the signed 64-bit integers "
                    "run files hold; the file is damaged or not written by training-lab.")
    return values.astype(np.int64)


def _read_coded_strings(group, i, codes, length, column, reader):
    """A version 2 string column: its codes and its distinct values."""
    h5py = reader.h5py
    text, ends = group.get(f"u{i}"), group.get(f"o{i}")
    if not (isinstance(text, h5py.Dataset) and isinstance(ends, h5py.Dataset)):
        reader.fail(f"the values of {column} are missing; the file is damaged or incomplete.")
    if not (reader.stored_as(text.id.get_type(), "int") and text.dtype == np.uint8
            and reader.stored_as(ends.id.get_type(), "int") and ends.ndim == 1):
        reader.fail(f"the values of {column} are stored as other types; the file is damaged.")
    codes, text, ends = codes[()].astype(np.int64), text[()], ends[()].astype(np.int64)
    if len(ends) and (ends[0] < 0 or np.any(np.diff(ends) < 0) or ends[-1] != len(text)) \
            or not len(ends) and len(text):
        reader.fail(f"the value offsets of {column} do not fit its text; the file is damaged.")
    if length and (codes.min() < -1 or codes.max() >= len(ends)):
        reader.fail(f"{column} refers to values it does not have; the file is damaged.")
    blob = text.tobytes()
    starts = np.concatenate([[0], ends[:-1]]).tolist()
    try:
        distinct = [blob[a:b].decode("utf-8") for a, b in zip(starts, ends.tolist())]
    except UnicodeDecodeError:
        reader.fail(f"the values of {column} are not UTF-8 text; the file is damaged.")
    return codes, distinct


def _read_strings(group, i, dataset, length, column, reader):
    h5py = reader.h5py
    if h5py.check_string_dtype(dataset.dtype) is None:
        reader.fail(f"{column} is marked string but holds {dataset.dtype}; the file is damaged.")
    missing = np.zeros(length, dtype=bool)
    if f"m{i}" in group:
        mask = group[f"m{i}"]
        if (not isinstance(mask, h5py.Dataset) or mask.shape != (length,)
                or not reader.stored_as(mask.id.get_type(), "bool")):
            reader.fail(f"the missing-value mask of {column} is damaged.")
        missing = mask[()]
    # Cells may share one string of the heap, so a column can decode to far
    # more text than the file holds: read in blocks that decode at most
    # _STRING_BLOCK_BYTES (by the largest string in the file's heaps), and stop
    # once more text was decoded than the file could hold distinct.
    _check_string_lengths(dataset, length, column, reader)
    block = max(1, min(1 << 16, _STRING_BLOCK_BYTES // reader.largest_string))
    limit = 16 * reader.size + (1 << 20)
    decoded, values = 0, []
    text = dataset.asstr("utf-8")
    for start in range(0, length, block):
        cells = text[start:start + block].tolist()
        decoded += sum(len(cell) for cell in cells)
        if decoded > limit:
            reader.fail(f"{column} decodes to more text than the file's {reader.size} bytes can hold "
                        "distinct; the file is damaged.")
        values.extend(cells)
    return values, missing


def _check_string_lengths(dataset, length, column, reader):
    """Refuses cells that declare strings longer than any in the file's heaps.

    HDF5 allocates the length a variable-length cell declares (up to 4 GiB)
    before it finds the heap object does not match; the cells of a contiguous
    dataset are read from the file first and checked here.
    """
    offset = dataset.id.get_offset()
    if offset is None or not length:
        return  # compact or unallocated: nothing on disk to look at
    address_size = dataset.file.id.get_create_plist().get_sizes()[0]
    cell = np.dtype([("length", "<u4"), ("collection", f"V{address_size}"), ("index", "<u4")])
    with open(reader.path, "rb") as file:
        file.seek(offset)
        cells = np.frombuffer(file.read(length * cell.itemsize), dtype=cell)
    if len(cells) == length and cells["length"].max() > reader.largest_string:
        reader.fail(f"{column} declares a string of {int(cells['length'].max())} bytes, longer than any "
                    "in the file; the file is damaged.")


def _records(columns):
    """Rows as dicts of plain Python values, as `Run` stores epochs and events."""
    length = len(next(iter(columns.values()))) if columns else 0
    plain = {name: values.tolist() for name, values in columns.items()}
    return [{name: values[i] for name, values in plain.items()} for i in range(length)]
