"""Failure paths, round 5 (smaller items): hostile clocks, optimizer slots on import, the
memory:// capacity, ``max_norm`` in the TF op."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.policies import EventClock

DIM = 4


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
