"""bigtable:// backend vs the best raw client approaches, side by side, on the emulator.

A table of N int64 keys (default 1M, ``--quick`` 100k), dim 64 (SGD layout, 288-byte records),
batches of 4096. Every approach writes the same keys into its own table (so none pays for
another's old cell versions), then reads look up random batches of the loaded keys. The
approaches run interleaved batch by batch, in an order that rotates every batch, so that the
load of a shared machine hits them alike; ratios are printed overall (total rows / total time)
and as the median of per-batch ratios.

Approaches
----------
backend put / get      ``BigtableBackend.put`` / ``.get`` (what ``embstore.open`` uses)
store lookup           ``EmbeddingStore.lookup(insert=False)``: the engine on top (context)
raw pb MutateRows      official protobuf ``MutateRowsRequest`` objects built per row, sent on the
                       gRPC channel, ``--inflight`` requests at once (REFERENCE: 271k rows/s)
client bulk_mutate     ``BigtableDataClient.table.bulk_mutate_rows`` with ``RowMutationEntry``
                       objects (REFERENCE: 35-38k rows/s); run on a subset, it is slow
async read_rows_sharded ``BigtableDataClientAsync`` ``read_rows_sharded`` over 4 shards per batch,
                       latest-cell filter (REFERENCE: 60k rows/s)

Usage: ``python bench/bench_bigtable.py [--quick] [--keys N] [--reads N]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from embstore.testing.bigtable_emulator import start_emulator

BATCH = 4096
DIM = 64
PROJECT, INSTANCE = "bench", "bench"


def rotate(items: list, r: int) -> list:
    r %= len(items)
    return items[r:] + items[:r]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Timing:
    """Rows and seconds per batch of one approach."""

    def __init__(self) -> None:
        self.rows = 0
        self.seconds = 0.0
        self.per_batch: list[float] = []  # seconds per row, batch by batch

    def add(self, rows: int, seconds: float) -> None:
        self.rows += rows
        self.seconds += seconds
        self.per_batch.append(seconds / max(rows, 1))

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")

    def paired_ratio(self, other: Timing) -> float:
        """Median over the batches both ran of (other's time per row / this one's)."""
        n = min(len(self.per_batch), len(other.per_batch))
        return statistics.median(o / m for m, o in zip(self.per_batch[:n],
                                                       other.per_batch[:n]))


def progress(what: str, b: int, n: int, timings: dict[str, Timing]) -> None:
    if (b + 1) % max(n // 5, 1) == 0 or b + 1 == n:
        print(f"  {what} {b + 1}/{n} batches: "
              + ", ".join(f"{k} {t.rate:,.0f}" for k, t in timings.items()), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k keys instead of 1M")
    ap.add_argument("--keys", type=int, default=None)
    ap.add_argument("--reads", type=int, default=None, help="keys looked up per round")
    ap.add_argument("--client-writes", type=int, default=None,
                    help="rows per round for the slow client bulk_mutate_rows baseline")
    ap.add_argument("--inflight", type=int, default=4)
    args = ap.parse_args()
    n_keys = args.keys or (100_000 if args.quick else 1_000_000)
    n_reads = args.reads or (24_576 if args.quick else 98_304)
    n_client = args.client_writes or (12_288 if args.quick else 40_960)

    warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
    emu = start_emulator()
    os.environ["BIGTABLE_EMULATOR_HOST"] = emu.host
    try:
        return run(emu, n_keys, n_reads, n_client, args.inflight)
    finally:
        emu.stop()


def run(emu, n_keys: int, n_reads: int, n_client: int, inflight: int) -> int:
    import grpc
    from google.cloud.bigtable.data import (
        BigtableDataClient,
        BigtableDataClientAsync,
        ReadRowsQuery,
        RowMutationEntry,
        SetCell,
    )
    from google.cloud.bigtable.data.row_filters import CellsColumnLimitFilter
    from google.cloud.bigtable_v2.types import bigtable as pb

    import embstore
    from embstore.backends.bigtable import wire

    print(f"Bigtable emulator {emu.host}; {n_keys:,} keys, dim {DIM}, batches of {BATCH}, "
          f"inflight {inflight}; {n_reads:,} reads; client objects write {n_client:,} rows")
    rng = np.random.default_rng(0)
    keys = rng.choice(2**62, n_keys, replace=False).astype(np.int64) - 2**61
    stores = {name: embstore.open(f"bigtable://{PROJECT}/{INSTANCE}/{name}", dim=DIM,
                                  optimizer="sgd", inflight=inflight)
              for name in ("backend", "rawpb", "client")}
    be = stores["backend"].backend
    layout = stores["backend"].layout
    recs = layout.empty(n_keys)
    recs["vector"] = rng.standard_normal((n_keys, DIM), dtype=np.float32)
    recs["version"] = 1
    print(f"record size {layout.itemsize} bytes")

    # -- raw protobuf MutateRows over the same kind of channel ------------------------------------
    channel = grpc.insecure_channel(emu.host, options=[("grpc.max_send_message_length", 1 << 28)])
    MutReq, MutResp = pb.MutateRowsRequest.pb(), pb.MutateRowsResponse.pb()
    mutate = channel.unary_stream("/google.bigtable.v2.Bigtable/MutateRows",
                                  request_serializer=MutReq.SerializeToString,
                                  response_deserializer=MutResp.FromString)
    rawpb_table = stores["rawpb"].backend.table_name
    pool = ThreadPoolExecutor(inflight)

    def rawpb_send(ks: np.ndarray, rs: np.ndarray) -> None:
        req = MutReq(table_name=rawpb_table)
        ts = time.time_ns() // 1_000_000 * 1000
        for rk, val in zip(wire.encode_int_keys(ks), rs.view(np.uint8).reshape(len(rs), -1)):
            cell = req.entries.add(row_key=rk.tobytes()).mutations.add().set_cell
            cell.family_name, cell.timestamp_micros, cell.value = "e", ts, val.tobytes()
        for resp in mutate(req):
            assert all(e.status.code == 0 for e in resp.entries)

    def rawpb_put(ks: np.ndarray, rs: np.ndarray) -> None:
        step = -(-len(ks) // inflight)
        list(pool.map(rawpb_send, [ks[i:i + step] for i in range(0, len(ks), step)],
                      [rs[i:i + step] for i in range(0, len(ks), step)]))

    # -- client objects ---------------------------------------------------------------------------
    client = BigtableDataClient(project=PROJECT)
    client_table = client.get_table(INSTANCE, "client")

    def client_put(ks: np.ndarray, rs: np.ndarray) -> None:
        ts = time.time_ns() // 1_000_000 * 1000
        entries = [RowMutationEntry(rk.tobytes(), [SetCell("e", b"", val.tobytes(), ts)])
                   for rk, val in zip(wire.encode_int_keys(ks),
                                      rs.view(np.uint8).reshape(len(rs), -1))]
        client_table.bulk_mutate_rows(entries)

    # -- writes -----------------------------------------------------------------------------------
    # Interleaved batch by batch (order rotating), so that the load of a shared machine hits
    # every approach alike; each approach writes the same keys into its own table.
    writers = [("backend put", be.put, n_keys), ("raw pb MutateRows", rawpb_put, n_keys),
               ("client bulk_mutate_rows", client_put, n_client)]
    w = {name: Timing() for name, _, _ in writers}
    n_batches = -(-n_keys // BATCH)
    for b in range(n_batches):
        sl = slice(b * BATCH, (b + 1) * BATCH)
        for name, put, limit in rotate(writers, b):
            if b * BATCH < limit:
                w[name].add(len(keys[sl]),
                            timed(lambda put=put, sl=sl: put(keys[sl], recs[sl])))
        progress("write", b, n_batches, w)
    stores["backend"].flush()

    # -- reads ------------------------------------------------------------------------------------
    loop = asyncio.new_event_loop()
    aclient, atable = loop.run_until_complete(_make_async_client(BigtableDataClientAsync))
    latest = CellsColumnLimitFilter(1)

    async def sharded(ks: np.ndarray) -> int:
        rks = [rk.tobytes() for rk in wire.encode_int_keys(np.sort(ks))]
        step = -(-len(rks) // 4)
        queries = [ReadRowsQuery(row_keys=rks[i:i + step], row_filter=latest)
                   for i in range(0, len(rks), step)]
        rows = await atable.read_rows_sharded(queries)
        vals = [row.cells[0].value for row in rows]
        return len(vals)

    def async_get(ks: np.ndarray) -> None:
        assert loop.run_until_complete(sharded(ks)) == len(ks)

    def backend_get(ks: np.ndarray) -> None:
        assert be.get(ks)[1].all()

    store = stores["backend"]

    def store_lookup(ks: np.ndarray) -> None:
        store.lookup(ks, insert=False)

    readers = [("backend get", backend_get), ("async read_rows_sharded", async_get),
               ("store lookup", store_lookup)]
    rd = {name: Timing() for name, _ in readers}
    sample = rng.choice(keys, n_reads, replace=False)
    n_batches = -(-n_reads // BATCH)
    for b in range(n_batches):
        ks = sample[b * BATCH:(b + 1) * BATCH]
        for name, get in rotate(readers, b):
            rd[name].add(len(ks), timed(lambda get=get, ks=ks: get(ks)))
        progress("read", b, n_batches, rd)
    loop.run_until_complete(aclient.close())
    loop.close()

    # -- report -----------------------------------------------------------------------------------
    print(f"\nrows/s ({n_keys:,}-key table, dim {DIM}, batch {BATCH}; total rows / total time):")
    for k, t in {**w, **rd}.items():
        print(f"  {k:<26} {t.rate:>12,.0f}   ({t.rows:,} rows)")
    best_w = max(("raw pb MutateRows", "client bulk_mutate_rows"), key=lambda k: w[k].rate)
    ratios = [("backend write", w["backend put"], best_w, w[best_w]),
              ("backend read", rd["backend get"], "async read_rows_sharded",
               rd["async read_rows_sharded"])]
    print()
    for label, mine, other_name, other in ratios:
        agg = mine.rate / other.rate
        paired = mine.paired_ratio(other)
        verdict = "OK" if agg >= 0.9 else "BELOW"
        print(f"{label} / {other_name}: {agg:.2f}x overall, {paired:.2f}x median per batch "
              f"-> {verdict} (target >= 0.9x)")
    print(f"store lookup / backend get: {rd['store lookup'].rate / rd['backend get'].rate:.2f}x"
          " (the engine on top of the backend)")
    for s in stores.values():
        s.close()
    client.close()
    channel.close()
    pool.shutdown()
    return 0


async def _make_async_client(cls):
    client = cls(project=PROJECT)
    return client, client.get_table(INSTANCE, "backend")


if __name__ == "__main__":
    sys.exit(main())
