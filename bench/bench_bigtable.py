"""bigtable:// backend vs the best raw client approaches, side by side, on the emulator.

A table of N int64 keys (default 1M, ``--quick`` 100k), dim 64 (SGD layout, 288-byte records),
batches of 4096. Writes load the table in ``--rounds`` rounds; each round every approach writes
its own share of the keys into its own table, so no approach pays for another's old versions.
Reads look up random batches of the loaded keys. Figures are medians over the rounds; the
order of the approaches rotates every round (the machine is shared and noisy).

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

Usage: ``python bench/bench_bigtable.py [--quick] [--keys N] [--reads N] [--rounds 5]``
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


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def rotate(items: list, r: int) -> list:
    r %= len(items)
    return items[r:] + items[:r]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k keys instead of 1M")
    ap.add_argument("--keys", type=int, default=None)
    ap.add_argument("--reads", type=int, default=None, help="keys looked up per round")
    ap.add_argument("--client-writes", type=int, default=None,
                    help="rows per round for the slow client bulk_mutate_rows baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=4)
    args = ap.parse_args()
    n_keys = args.keys or (100_000 if args.quick else 1_000_000)
    n_reads = args.reads or (16_384 if args.quick else 49_152)
    n_client = args.client_writes or (8_192 if args.quick else 24_576)
    rounds = args.rounds

    warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
    emu = start_emulator()
    os.environ["BIGTABLE_EMULATOR_HOST"] = emu.host
    try:
        return run(emu, n_keys, n_reads, n_client, rounds, args.inflight)
    finally:
        emu.stop()


def run(emu, n_keys: int, n_reads: int, n_client: int, rounds: int, inflight: int) -> int:
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
    from embstore.backends import _bigtable_wire as wire

    print(f"Bigtable emulator {emu.host}; {n_keys:,} keys, dim {DIM}, batches of {BATCH}, "
          f"{rounds} rounds, inflight {inflight}; {n_reads:,} reads/round")
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
    w: dict[str, list[float]] = {"backend put": [], "raw pb MutateRows": [],
                                 "client bulk_mutate_rows": []}
    parts = np.array_split(np.arange(n_keys), rounds)
    for r, part in enumerate(parts):
        # Rotate the order every round so that no approach always runs first on a busy box.
        for name, put, limit in rotate([("backend put", be.put, None),
                                        ("raw pb MutateRows", rawpb_put, None),
                                        ("client bulk_mutate_rows", client_put, n_client)], r):
            idx = part if limit is None else part[:limit]
            secs = timed(lambda put=put, idx=idx: [
                put(keys[idx[i:i + BATCH]], recs[idx[i:i + BATCH]])
                for i in range(0, len(idx), BATCH)])
            w[name].append(rate(len(idx), secs))
        print(f"  write round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in w.items()))
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

    rd: dict[str, list[float]] = {"backend get": [], "async read_rows_sharded": [],
                                  "store lookup": []}
    for r in range(rounds):
        sample = rng.choice(keys, n_reads, replace=False)
        for name, get in rotate([("backend get", backend_get),
                                 ("async read_rows_sharded", async_get),
                                 ("store lookup", store_lookup)], r):
            secs = timed(lambda get=get: [get(sample[i:i + BATCH])
                                          for i in range(0, len(sample), BATCH)])
            rd[name].append(rate(len(sample), secs))
        print(f"  read round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rd.items()))
    loop.run_until_complete(aclient.close())
    loop.close()

    # -- report -----------------------------------------------------------------------------------
    med = {k: statistics.median(v) for k, v in {**w, **rd}.items()}
    print(f"\nmedian rows/s ({n_keys:,}-key table, dim {DIM}, batch {BATCH}):")
    for k, v in med.items():
        print(f"  {k:<26} {v:>12,.0f}")
    best_w = max(med["raw pb MutateRows"], med["client bulk_mutate_rows"])
    best_r = med["async read_rows_sharded"]
    wr, rr = med["backend put"] / best_w, med["backend get"] / best_r
    print(f"\nbackend write / best raw write ({best_w:,.0f}): {wr:.2f}x "
          f"{'OK' if wr >= 0.9 else 'BELOW'} (target >= 0.9x)")
    print(f"backend read  / async read_rows_sharded ({best_r:,.0f}): {rr:.2f}x "
          f"{'OK' if rr >= 0.9 else 'BELOW'} (target >= 0.9x)")
    print(f"store lookup / backend get: {med['store lookup'] / med['backend get']:.2f}x")
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
