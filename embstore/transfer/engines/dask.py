"""Run the parts of a split job on Dask (``pip install -e '.[dask]'``).

Each part is one task (``client.submit(run_part, part, dest)``); a worker reopens the source
read-only from the part's URL, so the store is never shipped through the scheduler. A part
that fails is resubmitted alone (see :func:`embstore.transfer.engines.run_with_retries`).

>>> from dask.distributed import Client                             # doctest: +SKIP
>>> from embstore.transfer import plan_parts
>>> from embstore.transfer.engines.dask import run_parts_dask
>>> with Client("tcp://scheduler:8786") as client:
...     run_parts_dask(client, plan_parts("bigtable://p/i/t", 64), "/shared/export",
...                    fmt="parquet")
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ..parts import Part, PartResult, run_part
from . import Outcome, require, run_with_retries

__all__ = ["run_parts_dask"]


def run_parts_dask(client: Any, parts: list[Part], dest: str, *, fmt: str = "native",
                   batch_size: int = 65536, retries: int = 2,
                   on_part: Callable[[PartResult], None] | None = None,
                   on_failure: Callable[[Part, BaseException], None] | None = None
                   ) -> list[PartResult]:
    """Run ``parts`` as tasks of the ``dask.distributed`` ``client``; write the manifest.

    Parameters
    ----------
    client : distributed.Client
        Any cluster (``LocalCluster``, a Kubernetes or YARN deployment, ...). ``dest`` must
        be a directory every worker can write (a shared file system).
    parts : list of Part
        From :func:`embstore.transfer.plan_parts`.
    retries : int
        Times a failed part is submitted again, alone.
    on_part, on_failure : callable, optional
        Called in this process with each finished part's result / each failed attempt.

    Returns
    -------
    list of PartResult
        In part order.
    """
    distributed = require("distributed", "dask")

    def attempt(todo: list[Part]) -> Iterator[Outcome]:
        # a fresh key per attempt: Dask would hand back the failed task under the old one
        tag = uuid.uuid4().hex[:8]
        futs = {client.submit(run_part, p, dest, fmt=fmt, batch_size=batch_size,
                              key=f"embstore-part-{p.index + 1}-of-{p.count}-{tag}"): p
                for p in todo}
        for fut in distributed.as_completed(list(futs)):
            exc = fut.exception()
            yield futs[fut], (exc if exc is not None else fut.result())

    return run_with_retries(parts, attempt, dest, retries=retries, on_part=on_part,
                            on_failure=on_failure)
