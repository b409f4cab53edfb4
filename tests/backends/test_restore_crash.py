"""SIGKILL at random moments during ``load_state_dict`` leaves the old or the new table, on every
persistent backend (>= 20 kills each); memory:// restores interrupted at random moments inside
one process leave the old or the new table too (``tests/restore_crash.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from tests.builtin_backends import names  # noqa: E402
from tests.restore_crash import make_snapshots, run_kill_trials  # noqa: E402

KILLS = 20


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    a, b, expect = make_snapshots()
    d = tmp_path_factory.mktemp("snapshots")
    paths = [str(d / "a.pt"), str(d / "b.pt")]
    torch.save(a, paths[0])
    torch.save(b, paths[1])
    return a, paths, expect


@pytest.mark.parametrize("kind", names(lambda b: b.crash))
def test_sigkill_during_load_state_dict_leaves_the_old_or_the_new_table(new_store_url,
                                                                         snapshots, kind):
    from embstore_torch import DynamicEmbedding

    a, paths, expect = snapshots
    url = new_store_url(kind)
    with embstore.open(url, dim=8, optimizer="adagrad") as s:
        DynamicEmbedding(s).load_state_dict(a)
    report = run_kill_trials(url, paths, expect, trials=KILLS, seed=sum(map(ord, kind)))
    assert report.trials == KILLS
    assert report.restores_done > 0  # the children did restore between the kills
    assert sum(report.found.values()) == KILLS
    if kind == "rocksdb":  # what a killed restore left beside the store was cleaned up
        path = url.split("://", 1)[1]
        leftovers = [n for n in os.listdir(os.path.dirname(path)) if ".restore" in n]
        assert leftovers == []


def test_interrupted_memory_restores_leave_the_old_or_the_new_table():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "tests.restore_crash", str(KILLS)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{KILLS} interrupts" in out.stdout and "all consistent" in out.stdout
