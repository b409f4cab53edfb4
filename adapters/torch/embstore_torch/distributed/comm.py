"""The wire of :mod:`embstore_torch.distributed.store`: checked ``all_to_all`` exchanges of bytes.

Every collective operation of a distributed store starts with the same call on every rank, an
``all_to_all`` of a small int64 *header* per destination: ``(magic, op, sequence, items,
payload bytes, flag)``. That one exchange does three jobs:

- it carries the sizes of the payload exchange that follows (sizes first, then payloads, as
  ``all_to_all`` with unequal splits needs);
- every rank sees the op tag and sequence number of every other rank, so mismatched calls
  (rank 0 in ``lookup`` while rank 1 is in ``export``) raise :class:`CollectiveMismatchError`
  on all ranks instead of exchanging garbage or hanging;
- ``flag`` lets a rank tell the others something small (e.g. "I still need samples").

Payloads are byte buffers (numpy ``uint8`` views of keys, gradients, vectors), so one exchange
moves keys, counts and gradients together. The exchanges run on a gloo process group of the
store's own (CPU tensors, its own timeout) whatever the training's default backend is, so the
design is the same under NCCL. A collective that fails or times out (a rank died, raised or
hangs) raises :class:`RankFailureError`, and the store refuses further collectives: after a
failure the ranks no longer agree on where they are.

Nothing received is trusted: a header with a negative or absurd count or size, or whose
payload size does not fit its item count (``items x`` the row size of the op, checked by
:meth:`Comm.begin` against the bounds its caller gives, before the payload exchange: a receive
buffer sized by a lying header aborts gloo, SIGABRT), raises :class:`RankFailureError` before
anything is allocated or stored; a rank sends exactly the sizes its header announced (an
exchange that disagrees with its header raises on the sender instead of aborting the receiver
inside gloo).
The ranks that did not see the problem fail at their next exchange (an ``abort`` header, or
the timeout), so no rank goes on with a partial step.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from embstore.errors import EmbstoreError, StoreClosedError

__all__ = ["CollectiveError", "CollectiveMismatchError", "Comm", "RankFailureError",
           "StoreUnusableError", "MAX_MESSAGE", "MAX_PAYLOAD", "OPS", "rows_of"]

_MAGIC = 0x656D6273  # "embs"
_HEADER = 6
#: one rank may announce fewer bytes than this (16 GiB) to another in one exchange: larger
#: sizes, and negative ones, can only be garbage (and would be allocated before the exchange)
MAX_PAYLOAD = 1 << 34
#: the bound on small blobs every rank gives every other (errors, schemas, URLs; exclusive)
MAX_MESSAGE = 1 << 20

#: op tags carried by every header
OPS = {name: i + 1 for i, name in enumerate((
    "open", "lookup", "update", "len", "flush", "export", "close", "sample", "sample_round",
    "sample_prob", "top_k", "contains", "stats", "step", "abort", "prefetch", "assign", "delete",
))}
_NAMES = {v: k for k, v in OPS.items()}


class CollectiveError(EmbstoreError, RuntimeError):
    """A collective operation of a distributed store failed; the store is unusable after it."""


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collective operations (or the same one a different number of
    times): every rank must call the store's collectives in the same order."""


class StoreUnusableError(CollectiveError, StoreClosedError):
    """A collective on a distributed store that an earlier collective error left unusable:
    the ranks no longer agree on where they are, so the store is as good as closed."""


class RankFailureError(CollectiveError):
    """Another rank died, raised or hung: the exchange failed or timed out.

    Attributes
    ----------
    failed_rank : int or None
        The rank that failed, when it is known (it aborted, or sent garbage); None for a
        timeout or a broken connection, where any peer may be the one that is gone.
    """

    def __init__(self, message: str, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


#: ``fits(items, flags) -> (lo, hi, max_items)``: per rank, the payload sizes a header may
#: announce and the exclusive bound on its items (arrays over the ranks, or scalars)
Fits = Callable[[np.ndarray, np.ndarray], tuple[Any, Any, Any]]

_NO_LIMIT = np.iinfo(np.int64).max


def rows_of(lo: Any, hi: Any, *, base: Any = 0, max_items: Any = _NO_LIMIT) -> Fits:
    """``fits`` for a payload of ``items`` rows of ``lo`` to ``hi`` bytes each (plus ``base``
    bytes; each may be per rank). ``items x`` the row size is computed in float64: exact below
    2**53, far above any size a header may announce, and never overflowing."""
    def fits(items: np.ndarray, flags: np.ndarray) -> tuple[Any, Any, Any]:
        n = items.astype(np.float64)
        return n * lo + base, n * hi + base, max_items
    return fits


def _message(items: np.ndarray, flags: np.ndarray) -> tuple[Any, Any, Any]:
    return 0, MAX_MESSAGE - 1, _NO_LIMIT


class Comm:
    """Checked byte exchanges between the ranks of one process group.

    Parameters
    ----------
    group : ProcessGroup or None
        A gloo group; None creates one over all ranks (a collective call).
    timeout : float
        Seconds a collective may wait for the other ranks before it raises.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float = 300.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
            )
        if group is None:
            # The store's own gloo group: CPU tensors under any training backend (NCCL too),
            # and a timeout of its own so a dead rank surfaces here, not as a hang.
            group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=float(timeout)))
        self.group = group
        self.timeout = float(timeout)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.seq = 0
        self.bytes_sent = 0
        self.exchanges = 0
        self._buffers: dict[str, np.ndarray] = {}
        self.seconds = 0.0  # wall time inside exchanges (waiting for peers included)
        self.broken: str | None = None
        # bytes this rank's last header announced to each destination: the exchange right
        # after it sends exactly these, whatever it is handed (later exchanges of the same
        # collective, e.g. answers, size themselves from the headers on both sides)
        self._announced: np.ndarray | None = None

    # -- the two exchanges -------------------------------------------------------------------
    def begin(self, op: str, items: Sequence[int] | np.ndarray | int = 0,
              nbytes: Sequence[int] | np.ndarray | int = 0,
              flag: int | Sequence[int] | np.ndarray = 0, *, fits: Fits | None = None,
              fits_out: Fits | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Start collective ``op``: exchange headers, check that every rank is in ``op``.

        ``items`` / ``nbytes`` / ``flag`` are per destination (or one value for all). Returns,
        per source rank, the ``items``, ``nbytes`` and ``flag`` it sent to this rank.

        ``fits(items, flags)`` gives, per source rank, the ``(lo, hi)`` byte sizes its payload
        may have and the exclusive bound on its items (see :func:`rows_of`); a header outside
        them raises ``RankFailureError`` naming its sender before any payload moves (the
        payload exchange would size a buffer by it). ``fits_out`` does the same for the
        headers this rank sent, per destination (default: ``fits``), so a rank whose own
        header is wrong stops too instead of waiting for the receivers it lost.
        """
        if self.broken is not None:
            raise StoreUnusableError(f"the distributed store is unusable after an earlier "
                                     f"failure ({self.broken}); restart the job")
        self.seq += 1
        w = self.world
        head = np.empty((w, _HEADER), dtype=np.int64)
        head[:, 0] = _MAGIC
        head[:, 1] = OPS[op]
        head[:, 2] = self.seq
        head[:, 3] = items
        head[:, 4] = nbytes
        head[:, 5] = flag
        got = self._all_to_all(head.reshape(-1).view(np.uint8), [_HEADER * 8] * w,
                               [_HEADER * 8] * w, op).view(np.int64).reshape(w, _HEADER)
        self._announced = head[:, 4].copy()  # as sent (read back from the sent buffer)
        bad = (got[:, 0] != _MAGIC) | (got[:, 1] != OPS[op]) | (got[:, 2] != self.seq)
        aborted = np.flatnonzero(got[:, 1] == OPS["abort"])
        if len(aborted) and op != "abort":
            self.broken = f"rank {int(aborted[0])} aborted"
            raise RankFailureError(
                f"rank {int(aborted[0])} failed in its own part of a collective and aborted "
                f"(its error says why); rank {self.rank} stops at {op} #{self.seq}",
                failed_rank=int(aborted[0]))
        if not bad.any():
            self._check_sizes(got, op)
            if fits is not None:
                self._check_fit(op, got, fits, sent=False)
                self._check_fit(op, head, fits_out or fits, sent=True)
        if bad.any():
            seen = ", ".join(
                f"rank {r}: {_NAMES.get(int(got[r, 1]), '?')} #{int(got[r, 2])}"
                for r in range(w)
            )
            self.broken = "mismatched collective calls"
            raise CollectiveMismatchError(
                f"rank {self.rank} called {op} #{self.seq} but the ranks are in different "
                f"collective calls ({seen}); every rank must call lookup/update/sample/"
                "top_k/len/flush/export/close in the same order (a rank with an empty batch "
                "must still call)"
            )
        return got[:, 3].copy(), got[:, 4].copy(), got[:, 5].copy()

    def _check_sizes(self, got: np.ndarray, op: str) -> None:
        """Refuse headers whose counts or sizes cannot be real (before any allocation)."""
        items, nbytes = got[:, 3], got[:, 4]
        wrong = np.flatnonzero((items < 0) | (nbytes < 0) | (nbytes >= MAX_PAYLOAD))
        if len(wrong):
            r = int(wrong[0])
            self.broken = f"garbage header from rank {r}"
            raise RankFailureError(
                f"rank {self.rank}: rank {r} announced {int(items[r])} items in "
                f"{int(nbytes[r])} bytes for {op} #{self.seq}, which cannot be real (a bug or "
                "a corrupted message); the store stops here", failed_rank=r)

    def _check_fit(self, op: str, head: np.ndarray, fits: Fits, *, sent: bool) -> None:
        """Refuse headers whose size does not fit their item count (``fits``)."""
        items, nbytes = head[:, 3], head[:, 4]
        lo, hi, max_items = fits(items, head[:, 5])
        out = (items >= max_items) | (nbytes < lo) | (nbytes > hi)
        out[self.rank] = False  # this rank's own part never travels
        wrong = np.flatnonzero(out)
        if not len(wrong):
            return
        r = int(wrong[0])
        lo_r, hi_r, bound = (int(np.broadcast_to(v, out.shape)[r]) for v in (lo, hi, max_items))
        want = (f"fewer than {bound} items" if items[r] >= bound else
                f"{lo_r} bytes" if lo_r == hi_r else f"{lo_r} to {hi_r} bytes")
        what = f"{int(items[r])} items in {int(nbytes[r])} bytes for {op} #{self.seq}"
        if sent:
            self.broken = f"{op}: own header does not fit"
            raise CollectiveError(f"rank {self.rank}: its own header to rank {r} announced "
                                  f"{what} where {want} belong; the store stops here")
        self.broken = f"header from rank {r} does not fit"
        raise RankFailureError(f"rank {self.rank}: rank {r} announced {what} where {want} "
                               "belong (a bug or a corrupted message); the store stops here",
                               failed_rank=r)

    def fail(self, op: str, source: int | None, problem: str) -> RankFailureError:
        """An inconsistent payload received in ``op``: mark the store broken and return the
        error to raise (callers tell the other ranks with :meth:`abort` where the exchange
        protocol allows it)."""
        who = "a rank" if source is None else f"rank {source}"
        self.broken = f"bad payload from {who}"
        return RankFailureError(f"rank {self.rank}: {who} sent an inconsistent {op} payload: "
                                f"{problem}; the store stops here", failed_rank=source)

    def abort(self, reason: str) -> None:
        """Tell the other ranks that this rank failed in its own part of a collective: their
        next collective raises ``RankFailureError`` at once instead of waiting for the
        timeout. Waits (at most the timeout) for them to get there; never raises."""
        if self.broken is not None:
            return
        try:
            self.begin("abort")
        except CollectiveError:
            pass
        self.broken = reason

    @contextlib.contextmanager
    def aborting(self) -> Iterator[None]:
        """Around the parsing of received payloads: a ``RankFailureError`` (a payload that does
        not add up) tells the other ranks (:meth:`abort`) before it propagates, so they fail
        at their current or next collective instead of waiting for the timeout."""
        try:
            yield
        except RankFailureError as e:
            self.abort(str(e))
            raise

    def exchange(self, send: Sequence[np.ndarray | Sequence[np.ndarray]],
                 recv_nbytes: np.ndarray, op: str, *, keep: bool = False) -> list[np.ndarray]:
        """Send ``send[d]`` (an array, or a list of arrays sent back to back; any dtype) to
        rank ``d``; return what each rank sent here (``uint8`` arrays of the sizes announced
        in the headers).

        The returned arrays are views of a buffer the next exchange reuses (fresh memory
        costs page faults on every step); ``keep=True`` returns memory of their own.
        """
        segs: list[np.ndarray] = []
        sizes = []
        for part in send:
            n = 0
            for seg in ([part] if isinstance(part, np.ndarray) else part):
                raw = np.ascontiguousarray(seg).reshape(-1).view(np.uint8)
                segs.append(raw)
                n += len(raw)
            sizes.append(n)
        announced, self._announced = self._announced, None
        mismatch = (announced is not None and len(announced) == len(sizes)
                    and any(int(a) != s for a, s in zip(announced.tolist(), sizes)))
        buf = self.scratch("_send", sum(sizes))
        if segs:
            np.concatenate(segs, out=buf)
        if mismatch and announced is not None and (
                int(announced.min()) < 0 or int(announced.max()) >= MAX_PAYLOAD):
            # the receivers refused this header already (begin): nothing to send
            self.broken = f"{op}: garbage header sent"
            raise CollectiveError(f"rank {self.rank}: its own {op} header announced "
                                  f"impossible sizes {announced.tolist()}; the store stops here")
        if mismatch:
            # Send what the header announced (the receivers size their buffers by it; other
            # sizes abort them inside gloo), then fail here: the payload is not what it says.
            assert announced is not None
            starts = np.concatenate(([0], np.cumsum(sizes)))
            parts = [np.zeros(int(a), np.uint8) for a in announced.tolist()]
            for d, p in enumerate(parts):
                n = min(len(p), sizes[d])
                p[:n] = buf[starts[d]:starts[d] + n]
            sizes = [len(p) for p in parts]
            buf = np.concatenate(parts) if parts else buf[:0]
        recv = [int(n) for n in recv_nbytes]
        out = self._all_to_all(buf, sizes, recv, op, keep)
        if mismatch:
            assert announced is not None
            self.broken = f"{op}: payload sizes differ from the header"
            raise CollectiveError(
                f"rank {self.rank}: the {op} payload ({sum(len(s) for s in segs)} bytes) "
                f"differs from the sizes its header announced ({int(announced.sum())} bytes); "
                "the store stops here")
        bounds = np.concatenate(([0], np.cumsum(recv)))
        return [out[bounds[i]:bounds[i + 1]] for i in range(self.world)]

    def scratch(self, name: str, nbytes: int) -> np.ndarray:
        """A reusable ``uint8`` buffer of ``nbytes`` (grown geometrically, never shrunk)."""
        buf = self._buffers.get(name)
        if buf is None or len(buf) < nbytes:
            buf = np.empty(max(int(nbytes), 2 * (0 if buf is None else len(buf)), 1 << 16),
                           dtype=np.uint8)
            self._buffers[name] = buf
        return buf[:nbytes]

    def allgather(self, op: str, blob: np.ndarray, items: int = 0, flag: int = 0, *,
                  fits: Fits | None = None) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Give ``blob`` to every rank; return every rank's blob, items and flag. ``fits``:
        as in :meth:`begin`; by default a blob is smaller than :data:`MAX_MESSAGE`."""
        raw = np.ascontiguousarray(blob).reshape(-1).view(np.uint8)
        items_in, nbytes_in, flags = self.begin(op, items, len(raw), flag,
                                                fits=fits or _message)
        return self.exchange([raw] * self.world, nbytes_in, op), items_in, flags

    def _all_to_all(self, buf: np.ndarray, send_sizes: list[int], recv_sizes: list[int],
                    op: str, keep: bool = True) -> np.ndarray:
        if self.world == 1:  # nothing to exchange: gloo would only copy (measured ~0.5 ms)
            self.exchanges += 1
            return buf.copy() if keep else buf
        n = sum(recv_sizes)
        try:
            out = np.empty(n, dtype=np.uint8) if keep else self.scratch("_recv", n)
        except MemoryError as e:  # sizes the headers allowed, more than this machine has
            self.broken = f"{op}: no memory for {n} bytes"
            raise RankFailureError(f"rank {self.rank}: no memory to receive the {n} bytes of "
                                   f"{op} #{self.seq} the other ranks announced; the store "
                                   "stops here") from e
        t0 = time.perf_counter()
        try:
            dist.all_to_all_single(torch.from_numpy(out), torch.from_numpy(buf), recv_sizes,
                                   send_sizes, group=self.group)
        except Exception as e:
            self.broken = f"{op} failed: {e}"
            raise RankFailureError(
                f"rank {self.rank}: the {op} exchange with the other ranks failed or timed "
                f"out after {self.timeout:.0f} s (a rank died, raised or hangs; which one is "
                f"not known here, the others' errors say): {e}"
            ) from e
        self.seconds += time.perf_counter() - t0
        self.exchanges += 1
        # what leaves this process: the part addressed to itself is a local copy
        self.bytes_sent += sum(send_sizes) - send_sizes[self.rank]
        return out
