"""The Hypothesis state machine of the conformance suite: a store against a dict model."""

from __future__ import annotations

import numpy as np

import embstore

from ..valuetypes import round_trip
from .conformance_backend import DIM

#: relative tolerance of one 16-bit rounding
RTOL_16 = {"float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}


def make_state_machine(open_store, value_dtype: str = "float32"):
    """A Hypothesis state machine comparing a store with a dict model (SGD, lr=0.5).

    With a 16-bit ``value_dtype`` the store rounds to nearest and so does the model, after
    each step; values then agree within two units in the last place."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    key_st = st.integers(min_value=-20, max_value=20)
    batch_st = st.lists(key_st, min_size=0, max_size=12)
    lr = 0.5
    rtol = 1e-5 if value_dtype == "float32" else 2 * RTOL_16[value_dtype]

    def rounded(v: np.ndarray) -> np.ndarray:
        return round_trip(np.asarray(v, dtype=np.float32), value_dtype).astype(np.float64)

    class StoreStateMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store = open_store(optimizer=embstore.optim.SGD(lr=lr),
                                    stochastic_rounding=False)
            self.model: dict[int, np.ndarray] = {}

        def teardown(self) -> None:
            self.store.close()

        def _vec(self, k: int) -> np.ndarray:
            return self.model.get(k, self.store.initial_vectors([k])[0].astype(np.float64))

        @rule(keys=batch_st, insert=st.booleans())
        def lookup(self, keys, insert):
            got = self.store.lookup(np.array(keys, dtype=np.int64), insert=insert)
            for k, v in zip(keys, got):
                np.testing.assert_allclose(v, self._vec(k), rtol=rtol, atol=1e-6)
            if insert:
                for k in keys:
                    self.model.setdefault(k, self._vec(k))

        @rule(keys=batch_st, scale=st.floats(-2, 2, allow_nan=False))
        def update(self, keys, scale):
            g = np.full((len(keys), DIM), scale, np.float32) * (np.arange(DIM) + 1)
            self.store.update(np.array(keys, dtype=np.int64), g)
            acc: dict[int, np.ndarray] = {}
            for k, row in zip(keys, g.astype(np.float64)):
                acc[k] = acc.get(k, 0) + row
            for k, total in acc.items():
                self.model[k] = rounded(self._vec(k) - lr * total)

        @rule(keys=batch_st, value=st.floats(-3, 3, allow_nan=False))
        def assign(self, keys, value):
            vals = np.full((len(keys), DIM), value, np.float32)
            self.store.assign(np.array(keys, dtype=np.int64), vals)
            for k in keys:
                self.model[k] = rounded(np.full(DIM, np.float32(value)))

        @rule(keys=batch_st)
        def delete(self, keys):
            n = self.store.delete(np.array(keys, dtype=np.int64))
            assert n == len(set(keys) & set(self.model))
            for k in keys:
                self.model.pop(k, None)

        @precondition(lambda self: True)
        @rule()
        def scan(self):
            got = {k: v for ks, vs in self.store.items(batch_size=5)
                   for k, v in zip(ks.tolist(), vs)}
            assert set(got) == set(self.model)
            for k, v in got.items():
                np.testing.assert_allclose(v, self.model[k], rtol=rtol, atol=1e-6)

        @invariant()
        def sizes_agree(self):
            assert len(self.store) == len(self.model)

    return StoreStateMachine
