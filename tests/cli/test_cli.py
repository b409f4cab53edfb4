"""The ``embstore`` command line: exit codes, one-line errors, every command end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore.cli import main, shard_urls

COMMANDS = ("info", "export", "import", "copy", "verify", "head", "neighbors")


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """Run ``python -m embstore`` with output piped (so no progress bar may appear)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("EMBSTORE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "embstore", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


@pytest.fixture
def lmdb_store(tmp_path):
    """An LMDB store with 300 bytes keys, closed so commands can open it."""
    url = f"lmdb://{tmp_path}/src"
    with embstore.open(url, dim=8, key_type="bytes", optimizer="adagrad") as s:
        words = [f"w{i}".encode() for i in range(300)]
        s.lookup(words)
        s.update(words[:50], np.ones((50, 8), np.float32))
    return url


def _vectors(url: str) -> dict:
    with embstore.open(url, read_only=True) as s:
        return {k: v.tobytes() for keys, vecs in s.items(1000)
                for k, v in zip(keys.tolist(), vecs)}


def test_help_on_every_command():
    r = run("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in COMMANDS)
    for c in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([c, "--help"])
        assert e.value.code == 0


@pytest.mark.parametrize("args,needle", [
    (("info", "lmdb:///nonexistent/embstore-test-store"), "no store here"),
    (("info", "not-a-url"), "scheme://"),
    (("info", "nosuch://x"), "no backend for scheme"),
    (("import", "/nonexistent/file.txt", "memory://"), "No such file"),
    (("verify", "/nonexistent/file.emb"), "No such file"),
])
def test_user_errors_exit_1_with_one_line_and_no_traceback(args, needle):
    r = run(*args)
    assert r.returncode == 1
    assert r.stderr.startswith("embstore: error: ") and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_usage_errors_exit_2():
    r = run("export")
    assert r.returncode == 2 and "usage:" in r.stderr
    assert run("frobnicate").returncode == 2


def test_corrupt_import_through_subprocess_imports_nothing(tmp_path, lmdb_store):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"2 8\nw1 " + b"1 " * 8 + b"\n\xff\xfe " + b"1 " * 8 + b"\n")
    before = _vectors(lmdb_store)
    r = run("import", str(bad), lmdb_store)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "row 2" in r.stderr and "UTF-8" in r.stderr and "nothing was imported" in r.stderr
    assert _vectors(lmdb_store) == before
    r = run("import", str(bad), lmdb_store, "--skip-bad")
    assert r.returncode == 0, r.stderr
    assert "skipped 1 bad rows" in r.stderr
    # piped: the summary line only, no progress bar drawing
    assert "\r" not in r.stderr and "rows/s" not in r.stderr


def test_info_export_import_verify_round_trip(tmp_path, lmdb_store, capsys):
    assert main(["info", lmdb_store, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dim"] == 8 and info["key_type"] == "bytes" and info["rows"] == 300
    assert info["optimizer"]["name"] == "adagrad"
    assert [f[0] for f in info["layout"]["fields"]][:2] == ["vector", "accum"]
    assert main(["info", lmdb_store]) == 0
    assert "rows         300" in capsys.readouterr().out

    src = _vectors(lmdb_store)
    for fmt, name in [("native", "a.emb"), ("parquet", "a.parquet"), ("word2vec", "a.txt"),
                      ("word2vec-binary", "a.w2v"), ("npz", "a.npz"), ("tsv", "a.tsv")]:
        dest = tmp_path / name
        assert main(["export", lmdb_store, str(dest), "-f", fmt, "-q"]) == 0
        url = f"lmdb://{tmp_path}/from-{name}"
        assert main(["import", str(dest), url, "-f", fmt, "-q"]) == 0
        assert _vectors(url) == src, fmt
        assert main(["verify", str(dest), "-f", fmt]) == 0
    # a native import recreates the store's configuration (optimizer, slots, counts)
    with embstore.open(f"lmdb://{tmp_path}/from-a.emb", read_only=True) as s:
        assert s.optimizer.name == "adagrad"
        recs, _ = s.get_records([b"w0"])
        assert recs["count"][0] == 1
    # the digest printed by verify matches between the store and its exports
    capsys.readouterr()
    main(["verify", lmdb_store])
    main(["verify", str(tmp_path / "a.txt")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK: 300 rows") and out[0].split()[-1] == out[1].split()[-1]


def test_export_since_and_import_into_existing_store(tmp_path, lmdb_store, capsys):
    with embstore.open(lmdb_store) as s:
        v = s.version
        s.assign([b"new1", b"w3"], np.full((2, 8), 7, np.float32))
    assert main(["export", lmdb_store, str(tmp_path / "d.parquet"), "--since", str(v)]) == 0
    assert main(["verify", str(tmp_path / "d.parquet")]) == 0
    assert "OK: 2 rows" in capsys.readouterr().out
    dst = f"lmdb://{tmp_path}/dst"
    with embstore.open(dst, dim=8, key_type="bytes") as s:
        s.assign([b"old"], np.zeros((1, 8), np.float32))
    assert main(["import", str(tmp_path / "d.parquet"), dst, "-q"]) == 0
    with embstore.open(dst, read_only=True) as s:
        assert len(s) == 3 and (s.lookup([b"w3"], insert=False) == 7).all()
    # an existing store with another dim refuses (nothing written) unless projected
    assert main(["import", str(tmp_path / "d.parquet"), dst, "--dim", "4"]) == 1
    other = f"lmdb://{tmp_path}/dim4"
    with embstore.open(other, dim=4, key_type="bytes"):
        pass
    assert main(["import", str(tmp_path / "d.parquet"), other, "-q"]) == 1
    assert "dim 8" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "d.parquet"), other, "-q", "--project",
                 "truncate"]) == 0
    with embstore.open(other, read_only=True) as s:
        assert (s.lookup([b"w3"], insert=False) == 7).all()


def test_copy_reshards_and_preserves_records(tmp_path, lmdb_store, capsys):
    dst = f"lmdb://{tmp_path}/shard-{{i}}"
    assert main(["copy", lmdb_store, dst, "--shards", "3"]) == 0
    url = capsys.readouterr().err.strip().split(" to ")[-1]
    assert url.startswith("sharded://")
    with embstore.open(lmdb_store, read_only=True) as a, embstore.open(url, read_only=True) as b:
        keys = np.array([k for k, _ in _vectors(lmdb_store).items()], dtype=object)
        ra, _ = a.get_records(keys)
        rb, found = b.get_records(keys)
        assert found.all() and ra.tobytes() == rb.tobytes()
        assert [sh.url for sh in b.backend.shards] == shard_urls(dst, 3)
        sizes = [len(sh) for sh in b.backend.shards]
        assert sum(sizes) == 300 and min(sizes) > 50
    # and back into one plain store
    assert main(["copy", url, f"lmdb://{tmp_path}/merged", "-q"]) == 0
    assert _vectors(f"lmdb://{tmp_path}/merged") == _vectors(lmdb_store)


def test_shard_url_naming():
    assert shard_urls("lmdb:///d/t", 2) == ["lmdb:///d/t-0", "lmdb:///d/t-1"]
    assert shard_urls("sqlite:////d/t.db", 2) == ["sqlite:////d/t-0.db", "sqlite:////d/t-1.db"]
    assert shard_urls("bigtable://p/i/t{i}x", 2) == ["bigtable://p/i/t0x", "bigtable://p/i/t1x"]


def test_head_and_neighbors(tmp_path, capsys):
    url = f"lmdb://{tmp_path}/n"
    with embstore.open(url, dim=2, key_type="int64") as s:
        s.assign([1, 2, 3, 4], np.array([[1, 0], [0.9, 0.1], [0, 1], [-1, 0]], np.float32))
    assert main(["head", url, "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("count=0" in ln for ln in lines)
    assert main(["neighbors", url, "1", "-k", "2"]) == 0
    out = [ln.split("\t") for ln in capsys.readouterr().out.splitlines()]
    assert [o[1] for o in out] == ["2", "3"]
    assert main(["neighbors", url, "99"]) == 1
    assert "not in" in capsys.readouterr().err
    assert main(["neighbors", url, "abc"]) == 1


def test_verify_reports_damage(tmp_path, lmdb_store, capsys):
    p = tmp_path / "x.emb"
    assert main(["export", lmdb_store, str(p), "-q"]) == 0
    raw = bytearray(p.read_bytes())
    raw[-40] ^= 1
    p.write_bytes(bytes(raw))
    assert main(["verify", str(p)]) == 1
    assert "checksum" in capsys.readouterr().err
    t = tmp_path / "nan.tsv"
    t.write_text("a\t1 2\nb\tnan 2\n")
    assert main(["verify", str(t)]) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "NaN" in err


def test_refused_import_creates_no_store(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"2 3\nw 1 2 3\nv nan 2 3\n")
    assert main(["import", str(bad), f"lmdb://{tmp_path}/never", "-q"]) == 1
    assert not (tmp_path / "never").exists()


@pytest.mark.skipif(not os.path.exists("/usr/bin/script"), reason="needs script(1) for a pty")
def test_progress_bar_on_a_terminal_only(tmp_path):
    src = tmp_path / "v.tsv"
    src.write_text("".join(f"k{i}\t1 2 3\n" for i in range(5000)))
    cmd = (f"stty rows 40 cols 120; {sys.executable} -m embstore import {src} "
           f"lmdb://{tmp_path}/tty")
    r = subprocess.run(["/usr/bin/script", "-qc", cmd, "/dev/null"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "rows/s" in r.stdout and "5.00k/5.00k" in r.stdout
    r = run("import", str(src), f"lmdb://{tmp_path}/piped")
    assert r.returncode == 0 and "rows/s" not in r.stderr + r.stdout


def test_import_message_says_what_an_int8_file_brings_and_info_wraps_its_stats(tmp_path, capsys):
    import numpy as np

    import embstore
    from embstore.cli import main

    src = f"lmdb://{tmp_path}/src"
    with embstore.open(src, dim=8, optimizer="adagrad") as s:
        s.update(np.arange(10), np.ones((10, 8), np.float32))
        s.export(str(tmp_path / "serve.emb"), quantize="int8")
    assert main(["import", str(tmp_path / "serve.emb"), f"lmdb://{tmp_path}/dst",
                 "--dim", "8"]) == 0
    said = capsys.readouterr()
    said = said.out + said.err
    assert "int8 vectors, dequantized" in said and "existing keys keep theirs" in said
    assert main(["info", src]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines if not line.startswith("layout")) <= 100
    assert sum(1 for line in lines if line.startswith("stats")) == 1
