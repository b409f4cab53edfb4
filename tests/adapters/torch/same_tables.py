"""Training runs of a ``DynamicEmbeddingBagCollection`` to compare (:func:`train_collection`),
and what two runs over stores of the same features must share (:func:`assert_same_tables`):
every record field but the wall-clock stamps, and the store counters."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

COUNTERS = ("lookups", "hits", "misses", "inserts", "updates")


def assert_same_tables(a: dict, b: dict, keys: np.ndarray | None = None) -> None:
    """The stores of ``a`` and ``b`` (feature -> store) hold the same keys among ``keys``
    (default 0-399) with the same fields (``version`` and ``last_seen`` aside: clocks), and
    counted the same lookups, hits, misses, inserts and updates."""
    keys = np.arange(400, dtype=np.int64) if keys is None else keys
    assert a.keys() == b.keys()
    for f in a:
        (ra, fa), (rb, fb) = a[f].get_records(keys), b[f].get_records(keys)
        assert np.array_equal(fa, fb), f
        for name in ra.dtype.names:
            if name not in ("version", "last_seen"):  # wall-clock stamps
                assert np.array_equal(ra[fa][name], rb[fb][name]), (f, name)
        sa, sb = a[f].stats(), b[f].stats()
        for k in COUNTERS:
            assert sa[k] == sb[k], (f, k)


def train_collection(coll: Any, batches: list, threads: int = 1) -> tuple[list, list[str]]:
    """``(outputs, grad_fn names)`` of training ``coll`` on ``batches`` (keyed jagged), one
    step each against a fixed head, on ``threads`` torch threads (restored after)."""
    outs, nodes, head = [], [], None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kj in batches:
            values = coll(kj).values()
            nodes.append(type(values.grad_fn).__name__)
            head = torch.linspace(-1, 1, values.shape[1]) if head is None else head
            outs.append(values.detach().clone())
            (values * head).square().sum().backward()
    finally:
        torch.set_num_threads(before)
    return outs, nodes
