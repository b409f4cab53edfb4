"""Running the parts of a split job on an engine a team already has.

A part (:class:`embstore.transfer.Part`) is a picklable description; :func:`run_part` does it
alone, in any process. An engine only has to call it for every part and retry the ones that
fail; these recipes do that, each importing its engine when called (the engines are optional
extras, never dependencies of embstore):

- :func:`run_parts_local` — a process pool on this machine (no extra),
- :func:`embstore.transfer.engines.dask.run_parts_dask` — ``dask.distributed`` (``[dask]``),
- :func:`embstore.transfer.engines.beam.run_parts_beam` — Apache Beam, any runner (``[beam]``),
- Ray: a recipe in ``docs/cli.md`` (:func:`run_with_retries` around ``ray.remote``).

Every recipe reports each finished part (``on_part``), reruns only the parts that failed
(``retries``), and writes the manifest once all parts are in.
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from types import ModuleType

from ...errors import BackendUnavailableError, PartFailedError
from ..parts import Part, PartResult, finish_manifest, run_part

__all__ = ["Outcome", "require", "run_parts_local", "run_with_retries"]

#: what one attempt of one part came to: its result, or the exception it raised
Outcome = tuple[Part, "PartResult | BaseException"]


def require(module: str, extra: str) -> ModuleType:
    """Import an engine's module, or raise ``BackendUnavailableError`` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(
            f"running parts on {extra} needs {module}: pip install -e '.[{extra}]'") from e


def run_with_retries(parts: list[Part], attempt: Callable[[list[Part]], Iterable[Outcome]],
                     dest: str, *, retries: int = 2,
                     on_part: Callable[[PartResult], None] | None = None,
                     on_failure: Callable[[Part, BaseException], None] | None = None
                     ) -> list[PartResult]:
    """Run ``parts`` with ``attempt`` (an engine's: submit the parts, yield each outcome as
    it completes), rerun only the failed ones up to ``retries`` times, then write the
    manifest. Returns the results in part order; raises ``PartFailedError`` when a part
    still fails (the finished parts stay, and a rerun with
    :func:`embstore.transfer.pending_parts` does only the rest)."""
    done: dict[int, PartResult] = {}
    todo = list(parts)
    errors: dict[int, BaseException] = {}
    for _ in range(retries + 1):
        errors = {}
        for part, out in attempt(todo):
            if isinstance(out, BaseException):
                errors[part.index] = out
                if on_failure is not None:
                    on_failure(part, out)
                continue
            done[part.index] = out
            if on_part is not None:
                on_part(out)
        todo = [p for p in todo if p.index in errors]
        if not todo:
            break
    if todo:
        first = todo[0]
        raise PartFailedError(
            f"{len(todo)} of {len(parts)} parts failed after {retries} retries; part "
            f"{first.index + 1}/{first.count}: {errors[first.index]!r}") from errors[first.index]
    if parts:
        finish_manifest(dest, parts[0].count)
    return [done[i] for i in sorted(done)]


def run_parts_local(parts: list[Part], dest: str, *, workers: int = 2, fmt: str = "native",
                    batch_size: int = 65536, retries: int = 2,
                    on_part: Callable[[PartResult], None] | None = None,
                    on_failure: Callable[[Part, BaseException], None] | None = None,
                    pool: ProcessPoolExecutor | None = None) -> list[PartResult]:
    """Run ``parts`` on a pool of ``workers`` processes of this machine (or on ``pool``)."""
    own = pool is None
    # spawn: a worker never inherits open stores, locks or threads of this process
    ex = pool or ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

    def attempt(todo: list[Part]) -> Iterator[Outcome]:
        futs = {ex.submit(run_part, p, dest, fmt=fmt, batch_size=batch_size): p for p in todo}
        pending = set(futs)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                exc = f.exception()
                yield futs[f], (exc if exc is not None else f.result())

    try:
        return run_with_retries(parts, attempt, dest, retries=retries, on_part=on_part,
                                on_failure=on_failure)
    finally:
        if own:
            ex.shutdown()
