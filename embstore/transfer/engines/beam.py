"""Run the parts of a split job on Apache Beam (``pip install -e '.[beam]'``).

The pipeline is ``Create(parts) | Reshuffle() | ParDo(RunPartFn(dest))``: one element per
part, each written by embstore itself inside the ``DoFn`` (on Dataflow a worker opens
``bigtable://...`` with embstore's own Bigtable backend and reads its row range; no
per-row Beam IO). A runner retries a failed bundle, which after the reshuffle holds one
part, so a failed part is retried alone; :func:`embstore.transfer.pending_parts` picks the
parts a rerun of the whole job still has to do.

>>> from apache_beam.options.pipeline_options import PipelineOptions   # doctest: +SKIP
>>> run_parts_beam(plan_parts("bigtable://p/i/t", 256), "gs-fuse-mount/export",
...                options=PipelineOptions(runner="DataflowRunner", project="p", ...))
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..parts import Part, PartResult, checksum_of, finish_manifest, run_part
from . import require

__all__ = ["add_parts", "run_parts_beam"]


@functools.cache
def _dofn() -> type:
    beam = require("apache_beam", "beam")

    class RunPartFn(beam.DoFn):  # type: ignore[name-defined]
        """Write one part per element; emit its result as a JSON line."""

        def __init__(self, dest: str, fmt: str, batch_size: int) -> None:
            super().__init__()
            self.dest, self.fmt, self.batch_size = dest, fmt, batch_size
            self.done = beam.metrics.Metrics.counter("embstore", "parts_done")
            self.rows = beam.metrics.Metrics.counter("embstore", "rows_written")

        def process(self, part: Part) -> Iterator[str]:
            res = run_part(part, self.dest, fmt=self.fmt, batch_size=self.batch_size)
            self.done.inc()
            self.rows.inc(res.rows)
            yield json.dumps(res.__dict__)

    return RunPartFn


def add_parts(pcoll_root: Any, parts: list[Part], dest: str, *, fmt: str = "native",
              batch_size: int = 65536) -> Any:
    """Add the part-writing steps to a pipeline (``pcoll_root``: the ``Pipeline``); returns
    the PCollection of results (one JSON line per part)."""
    beam = require("apache_beam", "beam")
    return (pcoll_root
            | "embstore parts" >> beam.Create(parts)
            | "one part per bundle" >> beam.Reshuffle()
            | "write part" >> beam.ParDo(_dofn()(os.fspath(dest), fmt, batch_size)))


def run_parts_beam(parts: list[Part], dest: str, *, options: Any = None, fmt: str = "native",
                   batch_size: int = 65536,
                   on_part: Callable[[PartResult], None] | None = None) -> list[PartResult]:
    """Run ``parts`` in a Beam pipeline (``options``: its ``PipelineOptions``; the
    DirectRunner when None), then write the manifest. ``dest`` must be a directory every
    worker can write. ``on_part`` gets each part's result once the pipeline is done."""
    beam = require("apache_beam", "beam")
    with beam.Pipeline(options=options) as p:
        add_parts(p, parts, dest, fmt=fmt, batch_size=batch_size)
    if not parts:
        return []
    finish_manifest(dest, parts[0].count)
    with open(os.path.join(dest, "manifest.json"), "rb") as f:
        entries = {e["index"]: e for e in json.loads(f.read())["files"]}
    out = []
    for part in parts:  # may be a rerun's pending parts only
        e = entries[part.index]
        res = PartResult(e["index"], part.count, e["file"], e["rows"], e["bytes"],
                         checksum_of(e), e["range"], part.plan)
        if on_part is not None:
            on_part(res)
        out.append(res)
    return out
