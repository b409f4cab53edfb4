"""Candidate sampling over a store's keys, from metadata the store keeps (``count``).

Use it through the engine::

    res = store.sample(positive_keys, num_sampled=64, sampler=UnigramSampler(0.75))
    res.keys, res.is_positive, res.prob

and ``store.subsample_mask(keys, t=1e-3)`` for word2vec's frequency subsampling.
"""

from __future__ import annotations

from .candidate import expected_count, keep_probability, sample, sampling_index, subsample_mask
from .index import SamplingIndex, Snapshot
from .keyindex import KeyIndex
from .samplers import (
    FixedCandidatesSampler,
    LogUniformSampler,
    SampledResult,
    Sampler,
    UniformSampler,
    UnigramSampler,
    resolve_sampler,
)

__all__ = [
    "FixedCandidatesSampler",
    "KeyIndex",
    "LogUniformSampler",
    "SampledResult",
    "Sampler",
    "SamplingIndex",
    "Snapshot",
    "UniformSampler",
    "UnigramSampler",
    "expected_count",
    "keep_probability",
    "resolve_sampler",
    "sample",
    "sampling_index",
    "subsample_mask",
]
