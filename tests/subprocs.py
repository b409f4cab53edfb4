"""Helpers for tests that run embstore in other processes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import embstore
from embstore.testing.bigtable_emulator import free_port


def child_env() -> dict:
    """The environment of a child ``python`` that imports this checkout's embstore."""
    roots = [os.path.dirname(os.path.dirname(embstore.__file__))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*roots, *filter(None, [os.environ.get("PYTHONPATH")])])}


def run_ranks(entry: Callable[..., None], scenario: str, tmp_path: Any, *extra: Any,
              world: int = 2) -> list[dict]:
    """``entry(scenario, rank, port, outdir, *extra)`` on ``world`` spawned ranks; each writes
    ``rank-<r>.json`` into ``tmp_path``, returned in rank order. Every rank must exit 0."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=entry, args=(scenario, r, port, str(tmp_path), *extra))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    # a rank killed by a signal inside gloo (SIGABRT: exitcode -6) writes no result
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
    return [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(world)]
