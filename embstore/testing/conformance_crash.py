"""Opt-in conformance test: a writer killed with SIGKILL at random moments loses no acknowledged
batch and never leaves one half-applied (real processes; the harness is
:mod:`embstore.testing.crash`).

Subclass :class:`CrashConformance` with a ``url_factory`` fixture (a callable returning a fresh,
empty store URL per call), as for :class:`~embstore.testing.conformance.StoreConformance`.
Only persistent backends mean anything here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore

from .crash import run_crash_trials


class CrashConformance:
    """SIGKILL of a writing process; see the module docstring."""

    #: how many times a writer is killed
    crash_trials: int = 8
    #: options of every open (the writer acknowledges a batch once it is durable)
    crash_options: dict[str, Any] = {"durable": True}

    @pytest.fixture
    def url_factory(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a url_factory fixture")

    @pytest.mark.slow
    def test_sigkill_never_loses_acknowledged_or_half_applies(self, url_factory):
        url = url_factory()
        report = run_crash_trials(url, trials=self.crash_trials, options=self.crash_options,
                                  seed=len(url.split("://", 1)[0]))
        assert report.trials == self.crash_trials
        assert report.batches_acked > 0, "no batch was acknowledged: the test proved nothing"
        # The store is still a normal, writable store afterwards.
        with embstore.open(url, optimizer=embstore.optim.SGD(lr=1.0),
                           **self.crash_options) as s:
            s.assign([10_000], np.ones((1, s.dim)))
            assert len(s) == 513
