"""Writer leases that hold while their holder lives, over PostgreSQL and the Bigtable emulator.

Three ways a lease used to be erased or taken from a live write-back cache, each letting two
caches overwrite each other's updates: a plain (cache-less) writable open + close rewrote the
metadata without the leases; a holder on another machine with the same host name (another boot
id) was taken for a rebooted one and taken over; a writer whose clock runs ahead by more than
``lease_seconds`` took a live lease, and the old holder kept writing. Now the second writer is
refused, or the first one's next write fails (the lease is fenced): no update is lost.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import embstore
from embstore.errors import EmbstoreError, LeaseConflictError, LeaseFormatError, LeaseLostError
from embstore.layers.cache.lease import modify_leases, read_leases
from tests.subprocs import child_env

DIM = 4
LONG = 301.0  # a lease nobody waits for in a test
KEYS = np.arange(6, dtype=np.int64)
ONES = np.ones((len(KEYS), DIM), np.float32)


@pytest.fixture(params=["postgresql", "bigtable"])
def remote_url(request):
    factory = ("postgres_url_factory" if request.param == "postgresql"
               else "bigtable_url_factory")
    url = request.getfixturevalue(factory)()
    embstore.open(url, dim=DIM, optimizer=embstore.optim.SGD(lr=1.0),
                  initializer="zeros").close()
    return url


def _writer(url: str, **kw) -> embstore.EmbeddingStore:
    return embstore.open(url, cache="memory://", write_policy="back", **kw)


def _counts(url: str) -> list[int]:
    with embstore.open(url, read_only=True) as r:
        recs, found = r.get_records(KEYS)
        assert found.all()
        np.testing.assert_array_equal(recs["vector"][:, 0], -recs["count"])
        return recs["count"].tolist()


def _rewrite_leases(store: embstore.EmbeddingStore, **changes) -> None:
    """Change every stored lease entry as another machine's view of it would differ."""
    remote = store.backend.remote
    modify_leases(remote, lambda epoch, leases: (
        epoch, {k: {**v, **changes} for k, v in leases.items()}))


def test_a_plain_open_and_close_keeps_a_live_lease(remote_url):
    a = _writer(remote_url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    a.flush()
    # an evaluation script that forgot read_only=True: creates rows, writes the metadata
    with embstore.open(remote_url) as plain:
        plain.lookup(np.arange(100, 104))
    assert len(read_leases(a.backend.remote)[1]) == 1
    b = _writer(remote_url)
    with pytest.raises(LeaseConflictError, match="still running on this host"):
        b.update(KEYS, ONES)
    b.close()
    a.update(KEYS, ONES)
    a.close()
    assert _counts(remote_url) == [2] * len(KEYS)


def test_a_holder_on_another_boot_of_the_same_host_name_keeps_its_lease(remote_url):
    a = _writer(remote_url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    a.flush()
    # as a cache on a cloned VM (same host name, another boot id, a pid gone here) looks
    _rewrite_leases(a, boot="boot-id-of-another-machine", pid=2**22 + 7, start="1")
    b = _writer(remote_url)
    with pytest.raises(LeaseConflictError, match="same name but another boot"):
        b.update(KEYS, ONES)
    b.close()
    a.update(KEYS, ONES)   # still its lease
    a.close()
    assert _counts(remote_url) == [2] * len(KEYS)


def _skewed_writer(url: str, ahead: float) -> str:
    """A writer process whose clock runs ``ahead`` seconds early: the live lease of this
    process looks expired to it, so it takes the lease over and writes its updates."""
    code = textwrap.dedent(f"""
        import logging, time
        logging.basicConfig()
        _real = time.time
        time.time = lambda: _real() + {ahead}   # the injected fault: a clock running ahead
        import numpy as np, embstore
        s = embstore.open({url!r}, cache="memory://", write_policy="back")
        s.update(np.arange({len(KEYS)}), np.ones(({len(KEYS)}, {DIM}), np.float32))
        s.close()
    """)
    res = subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=120,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_a_takeover_under_clock_skew_fences_the_old_holder_out(remote_url):
    a = _writer(remote_url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    a.flush()
    log = _skewed_writer(remote_url, ahead=LONG + 60)
    assert _counts(remote_url) == [2] * len(KEYS)
    # a still believes it holds the lease: the update lands in its cache, the flush is refused
    a.update(KEYS, ONES)
    with pytest.raises(LeaseLostError, match="taken over"):
        a.flush()
    assert _counts(remote_url) == [2] * len(KEYS)   # the other writer's update is there
    with pytest.raises(LeaseLostError):   # and every later write is refused at once
        a.update(KEYS, ONES)
    assert "taking over the expired writer lease" in log   # the taker said so
    with pytest.raises(LeaseLostError, match=f"{len(KEYS)} updated rows"):
        a.close()
    assert a.closed


def test_fenced_writes_check_the_token_once_per_batch(remote_url):
    a = _writer(remote_url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    a.flush()
    remote = a.backend.remote
    holder, token = remote.fence
    epoch, leases = read_leases(remote)
    assert leases[holder]["token"] == token == epoch
    recs = a.get_records(KEYS)[0]
    modify_leases(remote, lambda e, leases: (   # a grant this writer did not get
        e + 1, {k: {**v, "token": e + 1} for k, v in leases.items()}))
    with pytest.raises(LeaseLostError):
        remote.put(KEYS, recs)
    _rewrite_leases(a, token=token)
    remote.put(KEYS, recs)
    a.close()
    # the next grant gets a larger token: a takeover always outranks the lease it replaces
    b = _writer(remote_url)
    b.update(KEYS, ONES)
    assert b.backend.remote.fence[1] == token + 2
    b.close()
    assert _counts(remote_url) == [2] * len(KEYS)


def test_postgres_checks_the_fence_inside_the_writes_transaction(postgres_server,
                                                                 postgres_url_factory):
    import json
    import threading

    import psycopg

    url = postgres_url_factory()
    embstore.open(url, dim=DIM, optimizer=embstore.optim.SGD(lr=1.0),
                  initializer="zeros").close()
    meta_table = url.rsplit("table=", 1)[1] + "_meta"
    a = _writer(url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    a.flush()
    a.update(KEYS, ONES)                       # dirty in a's cache
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            a.flush()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    with psycopg.connect(postgres_server.dsn) as taker, \
            psycopg.connect(postgres_server.dsn, autocommit=True) as watch:
        # a takeover under way: the lease row locked, a's lease about to be replaced
        text = taker.execute(f'SELECT value FROM "{meta_table}" WHERE name = %s FOR UPDATE',
                             ("leases",)).fetchone()[0]
        t = threading.Thread(target=flush)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()").fetchone()[0]:
            time.sleep(0.05)                   # until a's write transaction waits for the row
        record = json.loads(text)
        (entry,) = record["leases"].values()
        epoch = record["epoch"] + 1
        record = {"epoch": epoch, "leases": {"taker": {**entry, "pid": 1, "token": epoch}}}
        taker.execute(f'UPDATE "{meta_table}" SET value = %s WHERE name = %s',
                      (json.dumps(record), "leases"))
        taker.commit()
        t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], LeaseLostError), errors
    assert _counts(url) == [1] * len(KEYS)     # the write waited, then saw the takeover
    with pytest.raises(LeaseLostError):
        a.close()


def test_one_fence_check_per_write_batch_and_none_on_cached_updates(bigtable_url_factory):
    url = bigtable_url_factory()
    embstore.open(url, dim=DIM).close()
    s = _writer(url, lease_seconds=LONG, write_behind=False)
    cache, keys = s.backend, np.arange(12, dtype=np.int64)
    s.update(keys, np.ones((12, DIM), np.float32))     # takes the lease, reads the rows
    cache.flush()
    reads = cache.remote.counters["remote_reads"]
    for _ in range(5):                                 # the all-hit training step
        s.update(keys, np.ones((12, DIM), np.float32))
    assert cache.remote.counters["remote_reads"] == reads
    cache.whole.flush_batch = 4
    cache.flush()                                      # three write batches, three checks
    assert cache.remote.counters["remote_reads"] == reads + 3
    s.close()


def test_a_takeover_drops_rows_the_new_holder_read_before(remote_url):
    with embstore.open(remote_url) as plain:
        plain.lookup(KEYS)        # the rows exist (count 0)
    a = _writer(remote_url, lease_seconds=LONG)
    b = _writer(remote_url)
    b.lookup(KEYS, insert=False)  # b caches them before a writes them
    a.update(KEYS, ONES)
    a.close()                     # releases its lease
    b.update(KEYS, ONES)          # takes the lease: the rows are read again, not stepped stale
    b.close()
    assert _counts(remote_url) == [2] * len(KEYS)


# -- messages -------------------------------------------------------------------------------------
def test_lease_errors_and_warnings_hide_the_url_password(postgres_url_factory, caplog):
    url = postgres_url_factory()
    assert "://postgres@" in url
    url = url.replace("://postgres@", "://postgres:pw-s3cr3t@")  # trust auth: any password
    embstore.open(url, dim=DIM).close()
    a = _writer(url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    b = _writer(url)
    with pytest.raises(LeaseConflictError) as info:
        b.update(KEYS, ONES)
    assert "pw-s3cr3t" not in str(info.value) and "***" in str(info.value)
    _rewrite_leases(a, expires=time.time() - 1)   # as a taker whose clock runs ahead sees it
    with caplog.at_level(logging.WARNING, logger="embstore"):
        b.update(KEYS, ONES)
    assert "taking over the expired writer lease" in caplog.text
    assert "pw-s3cr3t" not in caplog.text
    a.update(KEYS, ONES)
    with pytest.raises(LeaseLostError) as lost:
        a.flush()
    assert "pw-s3cr3t" not in str(lost.value)
    b.close()
    with pytest.raises(LeaseLostError):
        a.close()


_MALFORMED = {
    "expires is text": {"epoch": 1, "leases": {"x": {"token": 1, "expires": "soon"}}},
    "expires is infinite": {"epoch": 1, "leases": {"x": {"token": 1, "expires": float("inf")}}},
    "expires beyond ctime": {"epoch": 1, "leases": {"x": {"token": 1, "expires": 1e300}}},
    "keys of one number": {"epoch": 1, "leases": {"x": {"token": 1, "expires": 4e9,
                                                        "keys": [1]}}},
    "pid is text": {"epoch": 1, "leases": {"x": {"token": 1, "expires": 4e9, "pid": "abc",
                                                 "host": os.uname().nodename}}},
    "entry is text": {"epoch": 1, "leases": {"x": "junk"}},
    "no token": {"epoch": 1, "leases": {"x": {"expires": 4e9}}},
    "record is a list": [1, 2],
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_a_malformed_lease_record_is_a_typed_error(tmp_path, case):
    url = f"sqlite:///{tmp_path}/r.db"
    embstore.open(url, dim=DIM).close()
    from embstore.registry import backend_class

    backend = backend_class(url)(url)
    backend.modify_leases(lambda _: _MALFORMED[case])
    backend.close()
    with _writer(url) as s:
        with pytest.raises(LeaseFormatError, match="malformed") as info:
            s.update(KEYS, ONES)
        assert isinstance(info.value, EmbstoreError)


def test_malformed_leases_in_the_metadata_are_a_typed_error(tmp_path):
    # backends without a lease record of their own keep it in the metadata
    url = f"lmdb://{tmp_path}/r"
    embstore.open(url, dim=DIM).close()
    from embstore.registry import backend_class

    backend = backend_class(url)(url)
    backend.modify_meta(lambda m: {**m, "writer_leases": {"x": {"expires": 1e300}}})
    backend.close()
    with _writer(url) as s:
        with pytest.raises(LeaseFormatError, match="malformed"):
            s.update(KEYS, ONES)


def test_leases_in_the_metadata_survive_a_plain_open_and_close(tmp_path):
    url = f"lmdb://{tmp_path}/r"
    embstore.open(url, dim=DIM).close()
    a = _writer(url, lease_seconds=LONG)
    a.update(KEYS, ONES)
    a.flush()
    with embstore.open(url) as plain:
        plain.lookup(np.arange(100, 104))
    assert len(read_leases(a.backend.remote)[1]) == 1
    a.close()
    with embstore.open(url, read_only=True) as r:
        assert read_leases(r.backend)[1] == {}


def test_a_lease_an_older_embstore_left_in_the_metadata_still_holds(tmp_path):
    url = f"lmdb://{tmp_path}/r"
    embstore.open(url, dim=DIM).close()
    from embstore.registry import backend_class

    backend = backend_class(url)(url)
    old = {"keys": None, "host": "another-host", "pid": 7, "expires": time.time() + LONG}
    backend.modify_meta(lambda m: {**m, "writer_leases": {"old-writer": old}})
    backend.close()
    with _writer(url) as s:
        with pytest.raises(LeaseConflictError, match="on another host"):
            s.update(KEYS, ONES)
