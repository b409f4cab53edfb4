"""Failure paths, round 5 (smaller items): hostile clocks, optimizer slots on import, the
memory:// capacity, ``max_norm`` in the TF op."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.policies import EventClock

DIM = 4


def _env() -> dict:
    roots = [os.path.dirname(os.path.dirname(embstore.__file__))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*roots, *filter(None, [os.environ.get("PYTHONPATH")])])}


# -- clocks: a reading the store's own import would refuse never stamps a row ---------------------
@pytest.mark.parametrize("make", [lambda: EventClock(-1e6), lambda: EventClock(float("inf")),
                                  lambda: EventClock().set(1e300),
                                  lambda: EventClock().set(2**63),
                                  lambda: EventClock().set("5"),
                                  lambda: EventClock(start=2.0**62).advance(1e6)])
def test_event_clock_refuses_times_a_restore_would_refuse(make):
    with pytest.raises(InvalidInputError, match=r"2\*\*62|not a number"):
        make()


def test_event_clock_advance_past_the_range_leaves_the_clock_unchanged():
    clock = EventClock()
    clock.advance(10.0)
    with pytest.raises(InvalidInputError):
        clock.advance(1e308)
    with pytest.raises(InvalidInputError):
        clock.advance(1e308)                 # twice used to reach inf
    with pytest.raises(InvalidInputError):
        clock.advance(-1.0)
    assert clock() == 10.0


@pytest.mark.parametrize("kind", ["memory", "lmdb", "sqlite"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, "1700000000", float("inf"), 2.0**63, None,
                                 10**400], ids=["nan", "negative", "str", "inf", "2**63", "None",
                                                "10**400"])
def test_a_hostile_clock_reading_raises_before_anything_is_written(new_store_url, tmp_path,
                                                                    kind, bad):
    now = [1000.0]
    s = embstore.open(new_store_url(kind), dim=DIM, clock=lambda: now[0],
                      optimizer=embstore.optim.Adagrad(0.1))
    s.update(np.arange(3), np.ones((3, DIM), np.float32))
    before, step, version = s.get_records(np.arange(3))[0].copy(), s.step, s.version
    now[0] = bad
    g = np.ones((3, DIM), np.float32)
    for write in (lambda: s.update(np.arange(3), g), lambda: s.update(np.arange(5, 8), g),
                  lambda: s.lookup(np.arange(10, 13)), lambda: s.assign(np.arange(3), g)):
        with pytest.raises(InvalidInputError, match="clock"):
            write()
    assert len(s) == 3 and s.step == step and s.version == version
    np.testing.assert_array_equal(s.get_records(np.arange(3))[0], before)
    now[0] = 2000.0
    path = str(tmp_path / "after.embstore")
    s.export(path)                        # what was saved restores
    with embstore.open("memory://", dim=DIM, optimizer=embstore.optim.Adagrad(0.1)) as t:
        t.import_(path)
        assert len(t) == 3
    s.close()


# -- optimizer slots: a record whose slots the optimizer cannot step on is refused on import ------
_SLOT_CASES = {
    "adagrad-nan": (lambda: embstore.optim.Adagrad(0.1), {}, "accum", float("nan")),
    "adagrad-neg": (lambda: embstore.optim.Adagrad(0.1), {}, "accum", -1.0),
    "adagrad-rowwise-neg": (lambda: embstore.optim.Adagrad(0.1, rowwise=True), {}, "accum",
                            -0.5),
    "adagrad-bf16-compact-neg": (lambda: embstore.optim.Adagrad(0.1),
                                 {"value_dtype": "bfloat16", "metadata": "compact"}, "accum",
                                 -1.0),
    "adagrad-rowwise-bf16-nan": (lambda: embstore.optim.Adagrad(0.1, rowwise=True),
                                 {"value_dtype": "bfloat16"}, "accum", float("nan")),
    "adam-m-nan": (lambda: embstore.optim.Adam(0.1), {}, "m", float("nan")),
    "adam-v-neg": (lambda: embstore.optim.Adam(0.1), {}, "v", -1.0),
    "adam-bf16-slots-v-inf": (lambda: embstore.optim.Adam(0.1, slot_dtype="bfloat16"), {}, "v",
                              float("inf")),
    "ftrl-n-neg": (lambda: embstore.optim.FTRL(0.1), {}, "n", -1.0),
    "ftrl-z-nan": (lambda: embstore.optim.FTRL(0.1), {}, "z", float("nan")),
    "momentum-inf": (lambda: embstore.optim.Momentum(0.1), {}, "momentum", float("-inf")),
}


def _bad_slot_file(opt, options, field, value) -> bytes:
    """A CRC-valid native export whose fourth record has ``value`` in slot ``field``."""
    import io

    from embstore.io.native import NativeWriter
    from embstore.valuetypes import from_float32

    src = embstore.open("memory://", dim=DIM, optimizer=opt, **options)
    src.update(np.arange(10, 16), np.ones((6, DIM), np.float32))
    recs = src.get_records(np.arange(10, 16))[0].copy()
    slot = np.full(recs[field][3].shape, value, np.float32)
    recs[field][3] = from_float32(slot, src.layout.slot_dtype)
    buf = io.BytesIO()
    with NativeWriter(buf, {**src.meta, "since": None}) as w:
        w.write(np.arange(10, 16, dtype=np.int64), recs)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["memory", "lmdb", "sqlite"])
@pytest.mark.parametrize("case", sorted(_SLOT_CASES))
def test_import_refuses_slots_the_optimizer_cannot_step_on(new_store_url, kind, case):
    from embstore.errors import CorruptFileError

    make_opt, options, field, value = _SLOT_CASES[case]
    blob = _bad_slot_file(make_opt(), options, field, value)
    with embstore.open(new_store_url(kind), dim=DIM, optimizer=make_opt(), **options) as s:
        s.update(np.arange(3), np.ones((3, DIM), np.float32))
        before = s.get_records(np.arange(3))[0].copy()
        for replace in (False, True):
            with pytest.raises(CorruptFileError, match=f"row 4: optimizer slot {field} "):
                s.import_(blob, replace=replace)
        assert len(s) == 3 and not s.contains(np.arange(10, 16)).any()
        np.testing.assert_array_equal(s.get_records(np.arange(3))[0], before)


def test_torch_snapshot_with_a_bad_slot_is_refused_and_the_store_kept():
    torch = pytest.importorskip("torch")
    from embstore.errors import CorruptFileError
    from embstore_torch import DynamicEmbedding

    opt = embstore.optim.Adagrad(0.1)
    with embstore.open("memory://", dim=DIM, optimizer=opt) as s:
        s.update(np.arange(3), np.ones((3, DIM), np.float32))
        before = s.get_records(np.arange(3))[0].copy()
        module = DynamicEmbedding(s)
        sd = module.state_dict()
        (key,) = [k for k in sd if k.endswith("_extra_state")]
        sd[key] = {**sd[key], "rows": _bad_slot_file(opt, {}, "accum", float("nan"))}
        with pytest.raises(CorruptFileError, match="optimizer slot accum"):
            module.load_state_dict(sd)
        np.testing.assert_array_equal(s.get_records(np.arange(3))[0], before)
        module(torch.tensor([0, 1])).sum().backward()       # trains on, no NaN written
        assert np.isfinite(s.lookup(np.arange(3))).all()


# -- memory:// initial_capacity: bounded; a table that cannot be made is a CapacityError -------
@pytest.mark.parametrize("url,kw", [
    ("memory://?initial_capacity=4000000000", {}),
    ("memory://?initial_capacity=1099511627776", {}),
    ("memory://?initial_capacity=-1", {}),
    ("memory://?initial_capacity=1.5", {}),
    ("memory://", {"initial_capacity": 2**40}),
    ("memory://", {"initial_capacity": -5}),
    ("memory://", {"initial_capacity": 1e3}),
    ("memory://", {"initial_capacity": True}),
])
def test_memory_initial_capacity_out_of_bounds_is_refused(url, kw):
    with pytest.raises(InvalidInputError, match="initial_capacity"):
        embstore.open(url, dim=DIM, **kw)


def test_memory_initial_capacity_beyond_half_the_machines_memory_is_refused():
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if physical // 2 >= 40 * 2**31:
        pytest.skip("a machine this large holds the largest table initial_capacity allows")
    want = min(physical // 40 + 1, 2**31)   # ~40 bytes of key table a key: more than all of it
    with pytest.raises(InvalidInputError, match="half this machine's"):
        embstore.open(f"memory://?initial_capacity={want}", dim=DIM)
    with embstore.open("memory://?initial_capacity=100000", dim=DIM) as s:
        s.lookup(np.arange(10))                             # a sensible value still works
        assert s.stats()["table_capacity"] >= 100000


_NO_MEMORY_FOR_THE_TABLE = """
import resource
import embstore
from embstore.errors import CapacityError
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), hard))
for key_type in ("int64", "bytes"):
    try:
        embstore.open("memory://?initial_capacity=20000000", dim=4, key_type=key_type)
    except MemoryError as e:
        print(key_type, type(e).__name__, isinstance(e, CapacityError))
"""


def test_a_table_that_cannot_be_allocated_raises_capacity_error():
    """Under an address-space limit the up-front table (~320 MiB) cannot be allocated: a
    CapacityError (still a MemoryError), not the compiled table's raw MemoryError."""
    r = subprocess.run([sys.executable, "-c", _NO_MEMORY_FOR_THE_TABLE], capture_output=True,
                       text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["int64 CapacityError True", "bytes CapacityError True"]
