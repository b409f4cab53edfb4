"""bigtable:// over the real emulator: conformance, plus retries, faults and Bigtable specifics."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import embstore
from embstore.backends.bigtable import wire
from embstore.errors import BackendError, InvalidInputError, InvalidURLError, StoreNotFoundError
from embstore.testing.bigtable_emulator import FaultInjector
from embstore.testing.conformance import FULL_CONFORMANCE, LayoutMatrix


class TestBigtableConformance(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self, bigtable_url_factory):
        return bigtable_url_factory


class TestBigtableLayouts(LayoutMatrix, TestBigtableConformance):
    """The suite over 16-bit and compact layouts, on the Bigtable emulator."""


DIM = 4


def _vals(n: int, base: float = 0.0) -> np.ndarray:
    return (np.arange(n * DIM, dtype=np.float32).reshape(n, DIM) + base)


# -- URLs, options, creation ----------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "bigtable://onlyproject", "bigtable://p/i", "bigtable://p/i/", "bigtable://p/i/t/extra",
    "bigtable:///i/t", "bigtable://p/Bad_Instance/t", "bigtable://p/i/bad table",
    "bigtable://p/i/t?x=1", "bigtable://p//t",
])
def test_bad_urls_are_refused(url, bigtable_emulator):
    with pytest.raises(InvalidURLError) as info:
        embstore.open(url, dim=DIM)
    assert isinstance(info.value, ValueError) and "bigtable" in str(info.value)


def test_bad_options_are_refused(bigtable_url_factory):
    url = bigtable_url_factory()
    for kw in ({"inflight": 0}, {"read_batch": -1}, {"retry_deadline": 0},
               {"column_family": "bad family"}):
        with pytest.raises(InvalidInputError):
            embstore.open(url, dim=DIM, **kw)


def test_missing_table_is_not_created_read_only_or_without_create(bigtable_url_factory):
    url = bigtable_url_factory()
    with pytest.raises(StoreNotFoundError):
        embstore.open(url, read_only=True)
    with pytest.raises(StoreNotFoundError, match="create=True"):
        embstore.open(url, dim=DIM, create=False)
    with embstore.open(url, dim=DIM) as s:  # the emulator default is create=True
        s.assign([1], _vals(1))
    with embstore.open(url, create=False) as s:
        np.testing.assert_array_equal(s.lookup([1], insert=False), _vals(1))


def test_second_column_family_in_the_same_table(bigtable_url_factory):
    url = bigtable_url_factory()
    with embstore.open(url, dim=DIM) as a, embstore.open(url, dim=2 * DIM,
                                                         column_family="other") as b:
        a.assign([1, 2], _vals(2))
        b.assign([1], np.ones((1, 2 * DIM)))
        assert len(a) == 2 and len(b) == 1
        np.testing.assert_array_equal(a.lookup([1, 2], insert=False), _vals(2))
        assert b.url == a.url and b.backend.reopen_options()["column_family"] == "other"


# -- encoding -------------------------------------------------------------------------------------
def test_hand_encoded_requests_equal_the_official_protobuf():
    from google.cloud.bigtable_v2.types import bigtable as pb

    keys = np.array([0, -1, 2**63 - 1, -(2**63), 7], dtype=np.int64)
    rk = wire.encode_int_keys(keys)
    vals = np.random.default_rng(0).integers(0, 256, (5, 300), dtype=np.uint8)
    head = wire.request_head("projects/p/instances/i/tables/t", "prof", 3)
    req = pb.MutateRowsRequest.pb()()
    req.table_name, req.app_profile_id = "projects/p/instances/i/tables/t", "prof"
    for k, v in zip(rk, vals):
        cell = req.entries.add(row_key=k.tobytes()).mutations.add().set_cell
        cell.family_name, cell.timestamp_micros, cell.value = "e", 1700000000000000, v.tobytes()
    parse = pb.MutateRowsRequest.pb().FromString
    assert parse(wire.mutate_rows_int(head, b"e", 1700000000000000, rk, vals)) == req
    assert parse(wire.mutate_rows_generic(head, b"e", 1700000000000000,
                                          [k.tobytes() for k in rk], vals)) == req
    np.testing.assert_array_equal(wire.decode_int_keys([k.tobytes() for k in rk]), keys)
    # byte order of the row keys is numeric order
    order = sorted(range(5), key=lambda i: rk[i].tobytes())
    assert keys[order].tolist() == sorted(keys.tolist())


# -- latest cell, ordering, reserved rows ---------------------------------------------------------
def test_reads_return_latest_cell_after_many_overwrites(bigtable_url_factory):
    # blind writes (compare-and-set writes delete the old versions of a cell they replace)
    s = embstore.open(bigtable_url_factory(), dim=DIM, check_and_set=False)
    keys = np.arange(20)
    for i in range(25):
        s.assign(keys, _vals(20, base=i))
    np.testing.assert_array_equal(s.lookup(keys, insert=False), _vals(20, base=24))
    assert len(s) == 20
    got = {k: v for ks, vs in s.items() for k, v in zip(ks.tolist(), vs)}
    np.testing.assert_array_equal(np.stack([got[k] for k in range(20)]), _vals(20, base=24))
    # the emulator really keeps old versions: without the filter the row has many cells
    be = s.backend
    raw = wire.read_rows_keys(be.conn.heads.read, wire.encode_int_keys(keys[:1]), b"")[:-2]
    cells = sum(len(r.chunks) for r in be.conn.stubs.read_rows(raw))
    assert cells > 1
    s.close()


def test_scan_is_in_key_order_and_skips_the_meta_row(bigtable_url_factory):
    s = embstore.open(bigtable_url_factory(), dim=DIM)
    keys = np.array([5, -3, 2**63 - 1, 0, -(2**63), 42, -1], dtype=np.int64)
    s.lookup(keys)
    scanned = np.concatenate([k for k, _ in s.items(batch_size=2)])
    assert scanned.tolist() == sorted(keys.tolist())
    b = embstore.open(bigtable_url_factory(), dim=DIM, key_type="bytes")
    words = [b"m", b"", b"meta", b"\x00", b"\xff" * 10, b"r"]
    b.assign(words, _vals(len(words)))
    assert len(b) == len(words)
    assert [k for ks, _ in b.items() for k in ks.tolist()] == sorted(words)
    np.testing.assert_array_equal(b.lookup(words, insert=False), _vals(len(words)))
    assert b.read_only is False and b.meta["key_type"] == "bytes"  # meta row intact
    with pytest.raises(InvalidInputError, match="shorter than"):
        b.assign([b"x" * 5000], _vals(1))
    assert len(b) == len(words)
    s.close()
    b.close()


def test_reopen_is_exact_with_optimizer_state(bigtable_url_factory):
    s = embstore.open(bigtable_url_factory(), dim=DIM, optimizer=embstore.optim.SGD(lr=0.3))
    keys = np.arange(-50, 50)
    for i in range(3):
        s.update(keys, np.full((100, DIM), 0.1 * (i + 1)))
    before = {k: r.tobytes() for ks, rs in s.records() for k, r in zip(ks.tolist(), rs)}
    url, step, version = s.url, s.step, s.version
    s.close()
    s2 = embstore.open(url)
    after = {k: r.tobytes() for ks, rs in s2.records() for k, r in zip(ks.tolist(), rs)}
    assert after == before and s2.step == step and s2.version == version
    s2.close()


def test_pickled_store_reaches_the_emulator_from_a_process_without_the_env(
        bigtable_url_factory, bigtable_emulator):
    s = embstore.open(bigtable_url_factory(), dim=DIM)
    s.assign([3, 4], _vals(2))
    s.flush()
    assert s.backend.reopen_options()["emulator_host"] == bigtable_emulator.host
    code = ("import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); "
            "print(s.lookup([3, 4], insert=False).sum())")
    env = {k: v for k, v in os.environ.items() if k != "BIGTABLE_EMULATOR_HOST"}
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(s), env=env,
                         capture_output=True, check=True, timeout=120)
    assert float(out.stdout) == float(_vals(2).sum())
    s.close()


def test_delete_reports_presence_and_clear_keeps_meta(bigtable_url_factory):
    s = embstore.open(bigtable_url_factory(), dim=DIM)
    s.assign(np.arange(10), _vals(10))
    assert s.delete([0, 1, 100]) == 2
    assert s.contains([0, 1, 2]).tolist() == [False, False, True]
    writes = s.stats()["remote_writes"]
    s.backend.clear()
    assert len(s) == 0
    assert s.stats()["remote_writes"] == writes, "clear should drop the range, not delete rows"
    s.close()
    assert embstore.open(s.url).dim == DIM


# -- retries (fault injection in front of the real emulator) --------------------------------------
def _open_with(url, injector, **kw):
    # batched MutateRows writes (the compare-and-set path:
    # tests/backends/test_concurrent_writers.py)
    return embstore.open(url, dim=DIM, interceptors=[injector], retry_deadline=10.0,
                         check_and_set=False, **kw)


@pytest.mark.parametrize("method", ["MutateRows", "ReadRows"])
def test_transient_errors_are_retried(bigtable_url_factory, method):
    url = bigtable_url_factory()
    with embstore.open(url, dim=DIM) as s:
        s.assign(np.arange(100), _vals(100))
    inj = FaultInjector(failures=0, methods=[method])
    s = _open_with(url, inj, write_batch=16, read_batch=16)
    inj.failures = 5  # armed after open: the faults hit data operations
    s.assign(np.arange(50, 150), _vals(100, base=1))
    got = s.lookup(np.arange(150), insert=False)
    assert inj.injected == 5
    assert s.stats()["retries"] >= 5
    np.testing.assert_array_equal(got[:50], _vals(100)[:50])
    np.testing.assert_array_equal(got[50:], _vals(100, base=1))
    codes = {c.name for c in inj.codes}
    assert codes == {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
    s.close()


def test_stream_aborted_mid_way_is_retried(bigtable_url_factory):
    url = bigtable_url_factory()
    with embstore.open(url, dim=DIM) as s:
        s.assign(np.arange(300), _vals(300))
    inj = FaultInjector(failures=0, methods=["ReadRows"], mid_stream=True,
                        codes=[grpc.StatusCode.ABORTED])
    s = _open_with(url, inj)
    inj.failures = 3
    np.testing.assert_array_equal(s.lookup(np.arange(300), insert=False), _vals(300))
    got = np.concatenate([v for _, v in s.items(batch_size=50)])  # scans resume too
    np.testing.assert_array_equal(got, _vals(300))
    assert inj.injected == 3
    s.close()


def test_retries_exhausted_raise_backend_error_and_change_nothing(bigtable_url_factory):
    url = bigtable_url_factory()
    with embstore.open(url, dim=DIM) as s:
        s.assign([1, 2], _vals(2))
    inj = FaultInjector(failures=0, methods=["MutateRows"])
    s = _open_with(url, inj)
    inj.failures = 10**9
    s.backend.retry_deadline = 0.3  # short only for the call that must fail
    with pytest.raises(BackendError) as info:
        s.assign([1, 2], _vals(2, base=9))
    s.backend.retry_deadline = 10.0
    msg = str(info.value)
    assert "write" in msg and "0.3 s" in msg and ("UNAVAILABLE" in msg
                                                   or "DEADLINE_EXCEEDED" in msg)
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, grpc.RpcError)
    inj.failures = 0
    np.testing.assert_array_equal(s.lookup([1, 2], insert=False), _vals(2))
    s.close()


def test_permanent_errors_are_not_retried(bigtable_url_factory):
    url = bigtable_url_factory()
    embstore.open(url, dim=DIM).close()
    inj = FaultInjector(failures=0, methods=["ReadRows"],
                        codes=[grpc.StatusCode.PERMISSION_DENIED])
    s = _open_with(url, inj)
    inj.failures = 100
    with pytest.raises(BackendError, match="read failed: PERMISSION_DENIED"):
        s.lookup([1])
    inj.failures = 0
    assert inj.injected == 1 and s.stats()["retries"] == 0
    s.close()


# -- a real emulator death ------------------------------------------------------------------------
def test_killed_emulator_fails_within_deadline_then_recovers_after_restart(
        bigtable_private_emulator):
    emu = bigtable_private_emulator
    url = "bigtable://test-project/test-instance/faults"
    killed = threading.Event()
    writes = []

    def kill_on_third_write(n, method):
        if method == "MutateRows" and armed.is_set():
            writes.append(n)
            if len(writes) == 3:
                emu.stop()  # SIGKILL, mid-way through a put of 16 requests
                killed.set()

    armed = threading.Event()
    inj = FaultInjector(failures=0, on_call=kill_on_third_write)
    s = embstore.open(url, dim=DIM, emulator_host=emu.host, write_batch=64, inflight=2,
                      interceptors=[inj], check_and_set=False)
    s.assign(np.arange(64), _vals(64))
    s.backend.retry_deadline = 1.0  # short only while the emulator is down: no timing flakes
    armed.set()
    t0 = time.monotonic()
    with pytest.raises(BackendError) as info:
        s.assign(np.arange(1000), _vals(1000, base=1))
    elapsed = time.monotonic() - t0
    assert killed.is_set() and not emu.running
    msg = str(info.value)
    assert "write gave up after 1 s" in msg
    assert "UNAVAILABLE" in msg or "DEADLINE_EXCEEDED" in msg
    assert elapsed >= 0.9  # it kept retrying until the deadline
    with pytest.raises(BackendError, match="read"):
        s.lookup([1], insert=False)

    emu.restart()  # same port, empty (the emulator keeps data in memory only)
    s.backend.retry_deadline = 30.0
    s.assign(np.arange(10), _vals(10, base=2))  # recreates the table and its metadata
    np.testing.assert_array_equal(s.lookup(np.arange(10), insert=False), _vals(10, base=2))
    assert len(s) == 10 and s.stats()["tables_recreated"] == 1
    s.close()
    reopened = embstore.open(url, emulator_host=emu.host)
    assert reopened.dim == DIM and len(reopened) == 10
    reopened.close()


def test_one_backend_used_from_several_threads(bigtable_url_factory):
    # The cache layer prefetches in a background thread while the trainer writes.
    s = embstore.open(bigtable_url_factory(), dim=DIM, read_batch=32, write_batch=32)
    errors: list[BaseException] = []

    def writer(offset: int) -> None:
        try:
            for i in range(5):
                ks = np.arange(offset + 100 * i, offset + 100 * (i + 1))
                s.assign(ks, np.full((100, DIM), float(offset + i), np.float32))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 10_000, 20_000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for o in (0, 10_000, 20_000):
        got = s.lookup(np.arange(o, o + 500), insert=False)
        np.testing.assert_array_equal(got[:, 0], np.repeat(np.arange(5) + o, 100))
    assert len(s) == 1500
    s.close()


def test_without_emulator_or_credentials_the_error_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.delenv("BIGTABLE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(BackendError, match="credentials.*BIGTABLE_EMULATOR_HOST"):
        embstore.open("bigtable://p/i/t", dim=DIM)


def test_scan_spanning_many_requests_and_bulk_load_last_wins(bigtable_url_factory):
    s = embstore.open(bigtable_url_factory(), dim=DIM)
    be = s.backend
    keys = np.arange(-150, 150, dtype=np.int64)
    recs = s.layout.empty(300)
    recs["vector"] = _vals(300)
    # batches overlap on keys 0..9: the later batch must win, as in one big put
    later = s.layout.empty(10)
    later["vector"] = -1.0
    assert be.bulk_load(iter([(keys, recs), (keys[150:160], later)])) == 300
    # batch_size 3 reads 48 rows per request: the scan resumes after each request's last key
    seen = np.concatenate([k for k, _ in s.items(batch_size=3)])
    assert seen.tolist() == keys.tolist()
    got = s.lookup(keys, insert=False)
    np.testing.assert_array_equal(got[150:160], np.full((10, DIM), -1.0, np.float32))
    np.testing.assert_array_equal(np.delete(got, np.s_[150:160], 0),
                                  np.delete(_vals(300), np.s_[150:160], 0))
    assert len(s) == 300
    s.close()
