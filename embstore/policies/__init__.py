"""Policies of the engine: admission (which keys get a row), expiry and capacity eviction
(which rows leave), and the tombstone log used by incremental sync."""

from __future__ import annotations

from .admission import (
    AdmissionPolicy,
    BloomAdmission,
    FrequencyCutoff,
    ProbabilisticAdmission,
    admission_from_config,
)
from .clock import EventClock
from .eviction import LFU, LRU, EvictionPolicy, LFUAging
from .expiry import Eviction, Expiry
from .sketch import CountMinSketch

__all__ = ["AdmissionPolicy", "FrequencyCutoff", "BloomAdmission", "ProbabilisticAdmission",
           "admission_from_config", "Expiry", "Eviction", "EvictionPolicy", "LRU", "LFU",
           "LFUAging", "CountMinSketch", "EventClock"]
