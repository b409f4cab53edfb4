"""Smaller failure paths: memory:// URL options, passwords in errors, a huge TSV line, the
Bigtable URL, truncated native files, the verify digest's two forms."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import embstore
from embstore.cli import main
from embstore.errors import BackendError, CorruptFileError, InvalidInputError


def _env() -> dict:
    roots = [os.path.dirname(os.path.dirname(embstore.__file__))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*roots, *filter(None, [os.environ.get("PYTHONPATH")])])}


# -- memory:// URL options: applied, or refused when unknown --------------------------------------
@pytest.mark.parametrize("url", ["memory://?bogus=1", "memory://?HASH_SEED=5",
                                 "memory://?hash_seed=x"])
def test_memory_url_refuses_unknown_or_bad_options(url):
    with pytest.raises(InvalidInputError):
        embstore.open(url, dim=4)


def test_memory_url_hash_seed_is_applied():
    def order(url):
        with embstore.open(url, dim=2) as s:
            s.assign(np.arange(500), np.zeros((500, 2), np.float32))
            return np.concatenate([k for k, _ in s.items()]).tolist()

    a, b = order("memory://?hash_seed=5"), order("memory://?hash_seed=5")
    assert a == b                                    # the same table layout: the seed is used
    assert a != order("memory://?hash_seed=6")
    with embstore.open("memory://?hash_seed=5", dim=2) as s:
        assert s.url == "memory://?hash_seed=5"


# -- a password given as an upper-case query parameter --------------------------------------------
def test_uppercase_password_parameter_is_not_shown():
    url = "postgresql+psycopg://u@127.0.0.1:1/db?PASSWORD=sekrit&table=t"
    with pytest.raises(BackendError) as info:
        embstore.open(url, dim=4)
    assert "sekrit" not in str(info.value) and "***" in str(info.value)


# -- an 80 MB single-line TSV is read with bounded memory ----------------------------------------
def test_huge_single_line_tsv_is_refused_within_bounded_memory(tmp_path):
    path = tmp_path / "one.tsv"
    with open(path, "wb") as f:
        f.write(b"k\t")
        block = b"0 " * (1 << 20)
        for _ in range(40):
            f.write(block)
        f.write(b"\n")
    code = textwrap.dedent(f"""
        import resource
        from embstore.io.formats import open_reader
        from embstore.errors import CorruptFileError
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            open_reader({str(path)!r}, "tsv")
        except CorruptFileError as e:
            print("refused:", e)
        print("grew_mb", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=_env())
    assert "refused:" in res.stdout and "more than" in res.stdout, res.stdout + res.stderr
    grew = int(res.stdout.split("grew_mb")[1])
    assert grew < 150, f"peak grew by {grew} MB"      # the read cap (64 MiB) plus slices


# -- Bigtable: store.url reopens the same emulator table -----------------------------------------
def test_bigtable_url_carries_the_emulator_host(bigtable_url_factory, bigtable_emulator):
    url = bigtable_url_factory()
    with embstore.open(url, dim=4) as s:               # host from BIGTABLE_EMULATOR_HOST
        s.assign([1], np.ones((1, 4), np.float32))
        assert s.url == f"{url}?emulator_host={bigtable_emulator.host}"
        reopen = s.url
    env = {k: v for k, v in _env().items() if k != "BIGTABLE_EMULATOR_HOST"}
    code = (f"import embstore\nwith embstore.open({reopen!r}, read_only=True) as s:\n"
            "    print(len(s), s.lookup([1], insert=False)[0, 0])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.stdout.split() == ["1", "1.0"], res.stdout + res.stderr
    with pytest.raises(embstore.errors.InvalidURLError):
        embstore.open(url + "?other=1", dim=4)


# -- a truncated native file says so ---------------------------------------------------------------
def test_truncated_native_file_is_reported_as_truncated(tmp_path):
    with embstore.open("memory://", dim=4) as s:
        s.assign(np.arange(3000), np.ones((3000, 4), np.float32))
        s.export(tmp_path / "t.emb", batch_size=1000)
    data = (tmp_path / "t.emb").read_bytes()
    for cut in range(200, len(data), 97):
        (tmp_path / "c.emb").write_bytes(data[:cut])
        with embstore.open("memory://", dim=4) as t:
            with pytest.raises(CorruptFileError, match="truncated file"):
                t.import_(tmp_path / "c.emb")


# -- verify: the Python report and the CLI show one digest -----------------------------------------
def test_verify_digest_hex_matches_the_cli(tmp_path, capsys):
    from embstore.transfer import verify_file

    with embstore.open("memory://", dim=4) as s:
        s.assign(np.arange(10), np.ones((10, 4), np.float32))
        s.export(tmp_path / "t.emb")
    rep = verify_file(tmp_path / "t.emb")
    assert main(["verify", str(tmp_path / "t.emb"), "-q"]) == 0
    out = capsys.readouterr().out
    assert f"digest {rep.digest_hex}" in out and int(rep.digest_hex, 16) == rep.digest
