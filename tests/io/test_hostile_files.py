"""Hostile and damaged import files (the corpus in ``tests/hostile``) against every format and
backend: a clear error naming the file, nothing written, no store left behind, one-line CLI
errors, bounded memory; and export destinations that are not regular files."""

from __future__ import annotations

import math
import os
import socket
import stat
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import embstore
from embstore.errors import (
    CorruptFileError,
    EmbstoreError,
    InvalidInputError,
)
from embstore.io import limits
from embstore.io.formats import open_reader
from embstore.transfer import export_file, import_file
from tests import hostile as h
from tests.builtin_backends import NAMES

BACKENDS = NAMES  # every built-in backend (tests/builtin_backends.py)


@pytest.fixture
def target(new_store_url):
    """target(kind) -> a fresh store URL of that backend (skips when it is not available)."""
    return new_store_url


@pytest.fixture(scope="session")
def bombs(tmp_path_factory):
    """The three memory bombs, built once (each takes a second or two)."""
    d = tmp_path_factory.mktemp("bombs")
    made: dict = {}

    def get(name: str):
        if name not in made:
            build = {"bomb.npz": h.npz_bomb, "bomb.parquet": h.parquet_bomb,
                     "admission.emb": h.native_admission_bomb}[name]
            made[name] = build(d / name)
        return made[name]

    return get


def _snapshot(store) -> dict:
    return {k: r.tobytes() for keys, recs in store.records(1000)
            for k, r in zip(keys.tolist(), recs)}


# (file name, builder, expected words in the message); every file here must be refused whole
REFUSED = {
    "version_max.emb": (lambda p: h.native_file(p, field="version", value=2**63 - 1), "version"),
    "count_negative.emb": (lambda p: h.native_file(p, field="count", value=-1), "count"),
    "last_seen_nan.emb": (lambda p: h.native_file(p, field="last_seen", value=math.nan),
                          "last_seen"),
    "last_step_max.emb": (lambda p: h.native_file(p, field="last_step", value=2**63 - 1),
                          "last_step"),
    "header_step.emb": (lambda p: h.native_file(p, header={"step": 1e30}), "step"),
    "header_version.emb": (lambda p: h.native_file(p, header={"version": 2**63 - 1}),
                           "version"),
    "deep_header.emb": (h.native_deep_header, "nested"),
    "zero_dim.emb": (h.native_zero_dim, "layout"),
    "full_with_deletions.emb": (h.native_full_with_deletions, "apply_deletes"),
    "version_max.parquet": (lambda p: h.parquet_file(p, field="version", value=2**63 - 1),
                            "version"),
    "step.parquet": (lambda p: h.parquet_file(p, header={"step": 2**70}), "step"),
    "deep_metadata.parquet": (h.parquet_deep_metadata, "nested"),
    "bad_crc.npz": (h.npz_bad_crc, "CRC"),
    "encrypted.npz": (h.npz_encrypted, "encrypted"),
    "method.npz": (h.npz_unsupported_method, "compression method"),
    "float64_overflow.npz": (h.npz_float64_overflow, "float32 range"),
    "fifo_dir": (h.npy_dir_with_fifo, "FIFO"),
    "lying_count.txt": (h.word2vec_lying_count, "header declares"),
    "nan.bin": (h.word2vec_binary_nan, "NaN"),
    "endless_line.tsv": (h.tsv_endless_line, "absurdly long"),
}


@pytest.fixture
def fifo_watchdog():
    """watch(dir): should a reader block on a FIFO in ``dir`` (the bug), open and close its
    write end after a while, so the test fails instead of hanging."""
    stop = threading.Event()
    threads = []

    def watch(d) -> None:
        def unblock() -> None:
            while not stop.wait(10):
                for p in d.iterdir() if d.is_dir() else ():
                    if p.is_fifo():
                        try:
                            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                        except OSError:
                            pass  # no reader is waiting on it

        t = threading.Thread(target=unblock, daemon=True)
        t.start()
        threads.append(t)

    yield watch
    stop.set()
    for t in threads:
        t.join()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_hostile_file_is_refused_and_store_untouched(name, backend, target, tmp_path,
                                                     fifo_watchdog):
    build, words = REFUSED[name]
    path = build(tmp_path / name)
    fifo_watchdog(path)
    with embstore.open(target(backend), dim=h.DIM, optimizer="adagrad") as store:
        store.lookup(np.arange(5, 9))
        before = _snapshot(store)
        with pytest.raises(EmbstoreError) as e:
            import_file(store, path)
        assert str(path) in str(e.value) and words in str(e.value)
        if name.endswith(".emb"):  # the engine's own native import checks the same
            with pytest.raises(EmbstoreError, match=words):
                store.import_(path)
        assert _snapshot(store) == before
        store.lookup(np.arange(5, 12))  # every write still works (no overflowing stamp)
        assert store.version < limits.MAX_STAMP and store.step < limits.MAX_STAMP


@pytest.mark.parametrize("name", ["bomb.npz", "bomb.parquet"])
def test_compression_bombs_are_refused_before_decoding(name, bombs):
    path = bombs(name)
    assert path.stat().st_size < 2 << 20  # ~1 MB / ~60 KB on disk, 1 GiB decoded
    # under a memory limit, so that a reader decoding the bomb fails instead of swapping
    r = _run_limited(
        "from embstore.transfer import import_file\n"
        "store = embstore.open('memory://', dim=1 << 20)\n"
        f"try:\n    import_file(store, {str(path)!r})\n"
        "except embstore.errors.CorruptFileError as e:\n"
        "    print('refused', len(store), e)\n")
    assert r.stdout.startswith("refused 0 "), r.stdout + r.stderr
    assert "compression bomb" in r.stdout


def _run_limited(code: str, headroom: int = 768 << 20) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose address space may grow by ``headroom``
    beyond what it uses once numpy, pyarrow and embstore are loaded (so a reader that
    decodes a bomb fails with MemoryError or is killed instead of finishing)."""
    prelude = (
        "import resource, sys, warnings\n"
        "import numpy, pyarrow.parquet, embstore.cli, embstore.transfer, embstore.io.npz\n"
        "import embstore.io.parquet\n"
        "vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
        f"resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, vm + {headroom}))\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               ARROW_DEFAULT_MEMORY_POOL="system")
    env.pop("EMBSTORE_DEBUG", None)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.parametrize("name", ["bomb.npz", "bomb.parquet"])
def test_bombs_under_a_memory_limit_give_a_clean_cli_error(name, bombs, tmp_path):
    path = bombs(name)
    r = _run_limited(f"sys.exit(embstore.cli.main(['import', '-q', {str(path)!r}, "
                     f"'lmdb://{tmp_path}/dst']))")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"embstore: error: {path}"), r.stderr
    assert "compression bomb" in lines[0]
    assert not (tmp_path / "dst").exists()


def test_admission_state_bomb_is_refused_under_a_memory_limit(bombs):
    path = bombs("admission.emb")
    code = (
        "from embstore.policies import FrequencyCutoff\n"
        "s = embstore.open('memory://', dim=4, optimizer='adagrad',\n"
        "                  admission=FrequencyCutoff(3, width=1 << 10, depth=2))\n"
        f"try:\n    s.import_({str(path)!r})\n"
        "except embstore.errors.CorruptFileError as e:\n"
        "    print('refused', len(s), e)\n"
    )
    r = _run_limited(code, headroom=256 << 20)
    assert r.returncode == 0 and r.stdout.startswith("refused 0 "), r.stdout + r.stderr
    assert "admission state" in r.stdout


def test_policy_state_decoding_is_bounded():
    from embstore.policies.admission import decode_state, encode_state

    assert decode_state(encode_state(b"abc" * 100), 300) == b"abc" * 100
    with pytest.raises(InvalidInputError, match="more than 299 bytes"):
        decode_state(encode_state(b"abc" * 100), 299)
    with pytest.raises(InvalidInputError, match="damaged"):
        decode_state("bm90IHpsaWI=", 1000)


# -- backend key limits: checked in the first pass -------------------------------------------------
LONG_KEY_FORMATS = {"native": "k.emb", "parquet": "k.parquet", "npz": "k.npz", "npy": "kdir",
                    "word2vec": "k.txt", "word2vec-binary": "k.bin", "tsv": "k.tsv"}


@pytest.mark.parametrize("backend", ["lmdb", "postgres", "bigtable"])
@pytest.mark.parametrize("fmt", sorted(LONG_KEY_FORMATS))
def test_key_too_long_for_the_backend_imports_nothing(fmt, backend, target, tmp_path):
    path = h.long_key_file(tmp_path / LONG_KEY_FORMATS[fmt], fmt)
    url = target(backend)
    with embstore.open(url, dim=h.DIM, key_type="bytes", optimizer="adagrad") as store:
        with pytest.raises(InvalidInputError, match="key of 4200 bytes is longer than"):
            import_file(store, path, fmt=fmt, batch_size=100)
        assert len(store) == 0
    if backend == "lmdb":  # and a store that did not exist is not created
        new = f"lmdb://{tmp_path}/new"
        r = _cli("import", "-q", str(path), new, "--format", fmt, "--batch-size", "100")
        assert r.returncode == 1 and "longer than" in r.stderr
        assert not (tmp_path / "new").exists()


def test_backends_declare_their_key_limits(tmp_path):
    with embstore.open(f"lmdb://{tmp_path}/l", dim=2, key_type="bytes") as s:
        assert limits.max_key_bytes(s.backend) == 510
        s.lookup([b"k" * 510])
        with pytest.raises(InvalidInputError):
            s.lookup([b"k" * 511])
    with embstore.open("memory://", dim=2, key_type="bytes",
                       shards=["memory://", f"lmdb://{tmp_path}/l2"]) as s:
        assert limits.max_key_bytes(s.backend) == 510


# -- deletions in native files ---------------------------------------------------------------------
def test_full_export_with_deletions_needs_an_explicit_flag(tmp_path):
    path = h.native_full_with_deletions(tmp_path / "f.emb", deleted=(21, 22, 23))
    store = embstore.open("memory://", dim=h.DIM, optimizer="adagrad")
    store.lookup([21, 22, 99])
    with pytest.raises(CorruptFileError, match="lists 3 deleted keys"):
        import_file(store, path)
    assert store.contains([21, 22, 99]).all()
    rep = import_file(store, path, apply_deletes=True)
    assert rep.deleted == 2 and rep.rows == 10
    assert store.contains([21, 22, 99]).tolist() == [False, False, True]
    store.lookup([21])
    assert store.import_(path, apply_deletes=True) == 10 and not store.contains([21])[0]


def test_delta_deletions_apply_and_are_reported(tmp_path):
    path = h.native_full_with_deletions(tmp_path / "d.emb", deleted=(21,), since=5)
    url = f"lmdb://{tmp_path}/s"
    with embstore.open(url, dim=h.DIM, optimizer="adagrad") as store:
        store.lookup([21, 22])
    r = _cli("import", str(path), url)
    assert r.returncode == 0, r.stderr
    assert "deleted 1 keys" in r.stderr
    with embstore.open(url) as store:
        assert store.contains([21, 22]).tolist() == [False, True]


def test_cli_apply_deletes_flag(tmp_path):
    path = h.native_full_with_deletions(tmp_path / "f.emb", deleted=(21,))
    url = f"lmdb://{tmp_path}/s"
    with embstore.open(url, dim=h.DIM, optimizer="adagrad") as store:
        store.lookup([21])
    r = _cli("import", "-q", str(path), url)
    assert r.returncode == 1 and "--apply-deletes" in r.stderr
    r = _cli("import", str(path), url, "--apply-deletes")
    assert r.returncode == 0 and "deleted 1 keys" in r.stderr, r.stderr


# -- the CLI: one line, exit 1, the file named -----------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="default")
    env.pop("EMBSTORE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "embstore", *args], capture_output=True,
                          text=True, timeout=60, env=env)


CLI_CASES = ["bad_crc.npz", "encrypted.npz", "method.npz", "deep_header.emb",
             "deep_metadata.parquet", "zero_dim.emb", "float64_overflow.npz", "fifo_dir",
             "header_step.emb"]


@pytest.mark.parametrize("name", CLI_CASES)
@pytest.mark.parametrize("command", ["import", "verify"])
def test_cli_reports_hostile_files_in_one_line(name, command, tmp_path):
    path = REFUSED[name][0](tmp_path / name)
    dst = tmp_path / "dst.db"
    args = ([command, str(path), f"sqlite:///{dst}"] if command == "import"
            else [command, str(path)])
    r = _cli(*args)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr
    assert lines[-1].startswith(f"embstore: error: {path}"), r.stderr
    if command == "import":
        assert len(lines) == 1, r.stderr
        assert not dst.exists()  # the store to create was not created


def test_float64_overflow_is_a_bad_row_without_a_numpy_warning(tmp_path):
    path = h.npz_float64_overflow(tmp_path / "f.npz")
    store = embstore.open("memory://", dim=h.DIM)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CorruptFileError, match="row 3: a value is beyond the float32"):
            import_file(store, path)
        rep = import_file(store, path, skip_bad=True)
    assert rep.rows == 3 and rep.skipped == 1 and not store.contains([2])[0]


def test_sqlite_open_without_dim_leaves_no_file(tmp_path):
    for url in (f"sqlite:///{tmp_path}/x.db", f"lmdb://{tmp_path}/l", f"rocksdb://{tmp_path}/r"):
        with pytest.raises(InvalidInputError, match="dim is required"):
            embstore.open(url)
    assert os.listdir(tmp_path) == []


def test_a_failed_write_pass_removes_the_store_it_created(tmp_path, monkeypatch):
    # a fault no real file produces once validated: the write pass dies after some rows
    from embstore.transfer import NewStore, creation_options
    from embstore.transfer import pipeline as transfer

    path = h.npz_valid(tmp_path / "v.npz", n=50)
    real = transfer._write

    def dying(store, *a, **k):
        store.assign(np.arange(3), np.zeros((3, h.DIM), np.float32))
        raise OSError("disk gone")

    monkeypatch.setattr(transfer, "_write", dying)
    with open_reader(path) as r:
        opts = creation_options(r)
    for url, left in ((f"lmdb://{tmp_path}/a/b", tmp_path / "a" / "b"),
                      (f"sqlite:///{tmp_path}/n.db", tmp_path / "n.db")):
        with pytest.raises(OSError, match="disk gone"):
            import_file(NewStore(url, opts), path)
        assert not left.exists()
    monkeypatch.setattr(transfer, "_write", real)
    assert import_file(NewStore(f"lmdb://{tmp_path}/a/b", opts), path).rows == 50


def test_chunks_are_bounded_in_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "CHUNK_BYTES", 64 << 10)
    dim = 4096  # 16 KiB rows (and their keys): 3 per chunk
    rng = np.random.default_rng(0)
    path = h.npz_file(tmp_path / "w.npz", np.arange(40, dtype="<i8"),
                      rng.standard_normal((40, dim)).astype("<f4"))
    with open_reader(path) as r:
        sizes = [len(c.keys) for c in r.chunks(65536)]
    assert sum(sizes) == 40 and max(sizes) == 3
    store = embstore.open("memory://", dim=dim)
    assert import_file(store, path).rows == 40


# -- export destinations ---------------------------------------------------------------------------
@pytest.fixture
def small():
    s = h.small_store()
    yield s
    s.close()


@pytest.mark.parametrize("fmt", ["native", "tsv", "npz", "parquet"])
def test_export_streams_into_a_fifo(fmt, small, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        assert export_file(small, fifo, fmt=fmt) == len(small)
    finally:
        if reader.is_alive():  # unblock the reader should the export have failed early
            with open(fifo, "wb"):
                pass
        reader.join(30)
    assert fifo.is_fifo()  # not replaced by a regular file
    out = tmp_path / ("copy." + {"native": "emb"}.get(fmt, fmt))
    out.write_bytes(got[0])
    dst = embstore.open("memory://", dim=h.DIM, optimizer="adagrad")
    assert import_file(dst, out, fmt=fmt).rows == len(small)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".embstore-")] == []


def test_export_to_a_character_device(small, tmp_path):
    # A null device of our own, never the system's /dev/null: code that renames over its
    # destination (the bug) must not be able to replace a device the whole machine uses.
    dev = tmp_path / "null"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot create a device node here: {e}")
    assert small.export(dev) == len(small)
    assert export_file(small, dev, fmt="word2vec") == len(small)
    assert stat.S_ISCHR(os.lstat(dev).st_mode)  # still the device, not a regular file
    assert [p.name for p in tmp_path.iterdir()] == ["null"]


def test_export_refuses_symlinks_and_sockets(small, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "out.emb"
    link.symlink_to(victim)
    dangling = tmp_path / "dangling.tsv"
    dangling.symlink_to(tmp_path / "nowhere")
    for dest, fmt in ((link, None), (link, "tsv"), (dangling, None)):
        with pytest.raises(InvalidInputError, match="symbolic link"):
            export_file(small, dest, fmt=fmt)
    with pytest.raises(InvalidInputError, match="symbolic link"):
        small.export(link)
    assert link.is_symlink() and victim.read_text() == "keep me"
    assert not (tmp_path / "nowhere").exists()
    sock_path = tmp_path / "s.tsv"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(InvalidInputError, match="a socket"):
            export_file(small, sock_path)
    url = f"lmdb://{tmp_path}/store"
    with embstore.open(url, dim=2) as s:
        s.lookup([1])
    r = _cli("export", url, str(link))  # the CLI says so in one line
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"embstore: error: {link}: is a symbolic link; export does not replace or write "
        "through links to files (export to the file it points at instead)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.tsv", "out.emb", "s.tsv",
                                                          "store", "victim.txt"]


def test_export_replaces_a_regular_file_atomically(small, tmp_path):
    dest = tmp_path / "t.tsv"
    dest.write_text("old")
    assert export_file(small, dest) == len(small)
    assert dest.read_text().count("\n") == len(small)


def test_partial_import_checks_each_chunk_before_writing_it(tmp_path):
    path = h.native_file(tmp_path / "v.emb", field="version", value=2**63 - 1, row=3)
    store = embstore.open("memory://", dim=h.DIM, optimizer="adagrad")
    with pytest.raises(CorruptFileError, match="row 4: version"):
        store.import_(path, partial=True)
    assert len(store) == 0  # the file is one chunk: nothing of it was written


def test_cli_error_line_for_unexpected_errors():
    import argparse

    from embstore.cli import error_line

    args = argparse.Namespace(src="/data/f.npz", url="lmdb:///x")
    deep = error_line(RecursionError("deep"), args)
    assert deep == "/data/f.npz: input nested too deeply to read"
    assert error_line(RuntimeError("boom\nmore"), args) == "/data/f.npz: RuntimeError: boom"
    assert error_line(InvalidInputError("lmdb:///x: no"), args) == "lmdb:///x: no"
    assert error_line(MemoryError(), args) == "/data/f.npz: out of memory"


def test_native_chunks_are_bounded_in_bytes(tmp_path, monkeypatch):
    from embstore.io import native

    monkeypatch.setattr(native, "MAX_CHUNK_BYTES", 1 << 12)
    s = h.small_store(n=40)  # adagrad dim 4: 64-byte records + 8 key bytes: 56 per 4 KiB
    keys, recs = h._records(s)
    with native.NativeWriter(tmp_path / "w.emb", s.meta) as w:
        w.write(np.concatenate([keys, keys + 100]), np.concatenate([recs, recs]))
    with native.NativeReader(tmp_path / "w.emb") as r:
        assert [len(k) for k, _ in r] == [56, 24]
