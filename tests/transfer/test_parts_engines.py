"""The parts of an export run on real engines: a local process pool, a Dask LocalCluster and
Apache Beam's DirectRunner; a failed part is retried alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.errors import PartFailedError
from embstore.transfer import pending_parts, plan_parts, verify_file, verify_store
from embstore.transfer.engines import run_parts_local
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.fixture
def source(tmp_path):
    url = f"lmdb://{tmp_path}/src"
    with embstore.open(url, dim=16) as store:
        keys = np.random.default_rng(0).integers(-2**62, 2**62, 3000)
        store.assign(keys, np.random.default_rng(1).standard_normal((3000, 16), np.float32))
    with embstore.open(url, read_only=True) as store:
        digest = verify_store(store).digest
    return url, digest


def _blocked(out: Path, index: int, count: int, ext: str) -> Path:
    """A directory where a part's file goes: the part's atomic rename fails there."""
    path = out / f"part-{index + 1:05d}-of-{count:05d}{ext}"
    path.mkdir(parents=True)
    (path / "x").write_bytes(b"")
    return path


def _retry_case(run, source, tmp_path, ext=".emb"):
    url, digest = source
    out = tmp_path / "out"
    parts = plan_parts(url, 3)
    blocker = _blocked(out, 1, 3, ext)
    finished, failed, inode = [], [], {}

    def on_failure(part, exc):
        failed.append(part.index)
        for f in blocker.iterdir():
            f.unlink()
        blocker.rmdir()  # cleared: the retry can write

    def on_part(res):
        finished.append(res.index)
        inode[res.file] = (out / res.file).stat().st_ino

    results = run(parts, str(out), on_part=on_part, on_failure=on_failure)
    assert failed == [1]
    # each part reported once, and none written again after it was reported
    assert sorted(finished) == [0, 1, 2] and [r.index for r in results] == [0, 1, 2]
    assert {name: (out / name).stat().st_ino for name in inode} == inode
    rep = verify_file(out / "manifest.json")
    assert rep.ok and rep.rows == 3000 and rep.digest == digest


def test_local_pool_retries_a_failed_part_alone(source, tmp_path):
    def run(parts, dest, **kw):
        return run_parts_local(parts, dest, workers=2, **kw)

    _retry_case(run, source, tmp_path)


def test_a_part_that_keeps_failing_is_reported_and_a_rerun_does_only_it(source, tmp_path):
    url, digest = source
    out = tmp_path / "out"
    parts = plan_parts(url, 3)
    _blocked(out, 2, 3, ".emb")
    with pytest.raises(PartFailedError, match="1 of 3 parts failed after 1 retries; part 3/3"):
        run_parts_local(parts, str(out), workers=2, retries=1)
    assert not (out / "manifest.json").exists()
    todo = pending_parts(parts, out)
    assert [p.index for p in todo] == [2]
    (out / "part-00003-of-00003.emb" / "x").unlink()
    (out / "part-00003-of-00003.emb").rmdir()
    run_parts_local(todo, str(out), workers=1)
    assert verify_file(out / "manifest.json").digest == digest


def test_dask_local_cluster_runs_the_parts_and_retries_a_failed_one(source, tmp_path):
    distributed = pytest.importorskip("distributed", reason="the [dask] extra is not installed")
    from embstore.transfer.engines.dask import run_parts_dask

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        def run(parts, dest, **kw):
            return run_parts_dask(client, parts, dest, fmt="parquet", **kw)

        _retry_case(run, source, tmp_path, ext=".parquet")


def _beam_python() -> str | None:
    """An interpreter with Apache Beam: this one, or the .venv-beam that `make test` builds
    (Beam pins protobuf and pyarrow below what the main venv holds)."""
    if importlib.util.find_spec("apache_beam") is not None:
        return sys.executable
    venv = os.environ.get("EMBSTORE_BEAM_VENV") or str(ROOT / ".venv-beam")
    py = os.path.join(venv, "bin", "python")
    return py if os.path.exists(py) else None


BEAM_SCRIPT = textwrap.dedent("""
    import os, sys
    from embstore.transfer import pending_parts, plan_parts
    from embstore.transfer.engines.beam import run_parts_beam

    url, out = sys.argv[1], sys.argv[2]
    parts = plan_parts(url, 3)
    seen = []
    res = run_parts_beam(parts, out, fmt="parquet", on_part=lambda r: seen.append(r.index))
    assert [r.index for r in res] == [0, 1, 2] and sorted(seen) == [0, 1, 2], (res, seen)
    print("rows", sum(r.rows for r in res))
    # a part lost after the run: the rerun does it alone
    os.unlink(os.path.join(out, "part-00002-of-00003.parquet"))
    os.unlink(os.path.join(out, "manifest.json"))
    todo = pending_parts(parts, out)
    print("pending", [p.index for p in todo])
    run_parts_beam(todo, out, fmt="parquet")
""")


def test_beam_direct_runner_runs_the_parts(source, tmp_path):
    py = _beam_python()
    if py is None:
        pytest.skip("no Apache Beam: not installed here and no .venv-beam (make beam-venv)")
    url, digest = source
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([py, "-c", BEAM_SCRIPT, url, str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows 3000" in proc.stdout and "pending [1]" in proc.stdout, proc.stdout
    rep = verify_file(out / "manifest.json")
    assert rep.ok and rep.rows == 3000 and rep.digest == digest
