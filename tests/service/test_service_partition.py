"""A worker cut from its Bigtable table by a real network partition (a network namespace,
``embstore.testing.netns``) stops acknowledging writes within one lease TTL, and after the
link heals loses none of the writes it acknowledged."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import embstore

pytest.importorskip("pyarrow.flight")
pytest.importorskip("google.cloud.bigtable")

from embstore.testing import netns  # noqa: E402
from embstore.testing.bigtable_emulator import find_emulator, start_emulator  # noqa: E402
from embstore.testing.service import start_worker  # noqa: E402

DIM = 4
TTL = 4.0


@pytest.fixture
def partitioned_emulator():
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    try:
        binary = find_emulator()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with netns.Netns() as ns:
        emu = start_emulator(binary=binary, address=ns.inside, prefix=ns.prefix)
        try:
            yield ns, emu
        finally:
            ns.heal()
            emu.stop()


def test_a_worker_cut_from_its_table_stops_acknowledging_within_one_ttl(partitioned_emulator):
    ns, emu = partitioned_emulator
    worker = start_worker(
        f"bigtable://netns/inst/t{os.getpid()}", env={"BIGTABLE_EMULATOR_HOST": emu.host},
        dim=DIM, optimizer=json.dumps({"name": "sgd", "lr": 1.0}), initializer="zeros",
        cache="memory://", write_policy="back", lease_seconds=TTL)
    one = np.ones((1, DIM), np.float32)
    acked = unsure = 0
    try:
        with embstore.open(f"des://{worker.address}", timeout=1.5) as des:
            des.update([1], one)
            des.flush()                       # the lease is held, the row is in the table
            acked += 1
            cut = time.monotonic()
            ns.cut()
            late: list[float] = []            # acknowledgements after the lease ran out
            failures = 0
            while time.monotonic() < cut + TTL + 6:
                try:
                    des.update([1], one)
                except embstore.errors.EmbstoreError:
                    failures += 1
                    unsure += 1               # a timed-out call may still be applied later
                    continue
                acked += 1
                done = time.monotonic()
                if done > cut + TTL:
                    late.append(done - cut)
                time.sleep(0.05)
            assert failures > 0
            assert late == [], f"writes acknowledged {late} s after the cut (TTL {TTL} s)"
            ns.heal()
            deadline = time.monotonic() + 60
            while True:                       # the worker serves again once it reaches the table
                try:
                    des.flush()
                    break
                except embstore.errors.EmbstoreError:
                    assert time.monotonic() < deadline, "the worker never recovered"
                    time.sleep(0.5)
            value = -float(des.lookup([1], insert=False)[0, 0])
        # every acknowledged update is in the table; a call that timed out may be too
        with embstore.open(f"bigtable://netns/inst/t{os.getpid()}", read_only=True,
                           emulator_host=emu.host) as table:
            stored = -float(table.lookup([1], insert=False)[0, 0])
        assert acked <= value <= acked + unsure
        assert stored == value
    finally:
        worker.kill()
