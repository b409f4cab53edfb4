"""What an installed embstore can do with the extras it has: run from outside the checkout.

    python tests/install_check.py [--block] CHECK...

``core``     the memory:// quick start (open, lookup, update, assign, top-k, sample, export to the
             native format and import it back, a sharded store) imports no optional driver
``cli``      ``embstore --help`` (the console script beside this Python, else ``-m embstore``)
``missing``  opening each backend whose driver is missing raises BackendUnavailableError naming
             the backend and its extra
``lmdb`` ``rocksdb`` ``sql`` ``parquet`` ``bloom``   a store really written, reopened and read
``postgres`` ``bigtable``   the same against a throwaway server / the emulator (the launchers in
             embstore.testing) where their binaries are here, else the backend and its driver
             import

``--block`` makes every optional driver unimportable first (a meta-path finder), as in a venv
without extras. ``make check-install`` runs this in fresh venvs;
tests/project/test_bare_install.py runs it with ``--block`` in the development venv.
"""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
import tempfile

DRIVERS = ("lmdb", "rocksdict", "sqlalchemy", "psycopg", "psycopg2", "google", "grpc", "pyarrow",
           "pybloom_live", "torch", "tensorflow", "keras")

# scheme -> (a URL under a temporary directory, the extra its message must name)
BACKENDS = {
    "lmdb": ("lmdb://{d}/lmdb", "lmdb"),
    "rocksdb": ("rocksdb://{d}/rocks", "rocksdb"),
    "sqlite": ("sqlite:///{d}/t.db", "sql"),
    "postgresql": ("postgresql+psycopg://postgres@127.0.0.1:9/db", "postgres"),
    "bigtable": ("bigtable://p/i/t", "bigtable"),
}


class _Blocker(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.tried: list[str] = []

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in DRIVERS:
            self.tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def _drivers_loaded() -> list[str]:
    return sorted(m for m in sys.modules if m.split(".")[0] in DRIVERS)


def check_core(tmp: str) -> None:
    import numpy as np

    import embstore

    with embstore.open("memory://", dim=8, optimizer=embstore.optim.Adagrad(lr=0.1)) as store:
        ids = np.array([3, 17, 3, 99], dtype=np.int64)
        vecs = store.lookup(ids)
        store.update(ids, np.full_like(vecs, 0.1))
        store.assign([5], np.ones((1, 8), np.float32))
        assert store.contains([3, 4]).tolist() == [True, False]
        keys, _ = store.top_k(vecs[:1], k=2)
        assert keys.shape == (1, 2)
        assert len(store.sample([3], num_sampled=2).keys) >= 1
        path = os.path.join(tmp, "table.emb")
        assert store.export(path) == len(store) == 4
        with embstore.open("memory://", dim=8, optimizer=embstore.optim.Adagrad(lr=0.1)) as copy:
            copy.import_(path)
            probe = np.array([3, 5, 17, 99], np.int64)
            assert np.array_equal(copy.lookup(probe, insert=False),
                                  store.lookup(probe, insert=False))
    with embstore.open("sharded://?shard=memory://&shard=memory://", dim=4) as sharded:
        sharded.lookup(np.arange(100, dtype=np.int64))
        assert len(sharded) == 100
    loaded = _drivers_loaded()
    assert not loaded, f"the memory:// quick start imported optional drivers: {loaded}"


def check_cli() -> None:
    script = os.path.join(os.path.dirname(sys.executable), "embstore")
    if os.path.exists(script):
        out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    else:  # the development venv: the checkout is on PYTHONPATH, not installed as a script
        out = subprocess.run([sys.executable, "-m", "embstore", "--help"], capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 0 and "export" in out.stdout, out.stderr[-2000:]


def check_cli_in_process() -> None:
    import contextlib
    import io

    from embstore.cli import main

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(["--help"])
    except SystemExit as e:
        assert e.code == 0, e.code
    assert "export" in out.getvalue(), out.getvalue()
    loaded = _drivers_loaded()
    assert not loaded, f"embstore --help imported optional drivers: {loaded}"


def check_missing(tmp: str, schemes: list[str] | None = None) -> None:
    import embstore
    from embstore.errors import BackendUnavailableError

    for scheme in schemes or list(BACKENDS):
        url, extra = BACKENDS[scheme]
        try:
            embstore.open(url.format(d=tmp), dim=4).close()
        except BackendUnavailableError as e:
            msg = str(e)
            assert f"'{scheme}'" in msg and f".[{extra}]" in msg, msg
        else:
            raise AssertionError(f"{scheme}: opened without its driver")
    path = os.path.join(tmp, "t.parquet")
    with embstore.open("memory://", dim=4) as store:
        store.lookup([1])
        try:
            store.export(path)
        except BackendUnavailableError as e:
            assert ".[parquet]" in str(e), e
        else:
            raise AssertionError("exported Parquet without pyarrow")
    try:
        embstore.open("memory://", dim=4, admission=embstore.policies.BloomAdmission())
    except BackendUnavailableError as e:
        assert ".[bloom]" in str(e), e
    else:
        raise AssertionError("BloomAdmission built without pybloom-live")


def _roundtrip(url: str) -> None:
    import numpy as np

    import embstore

    with embstore.open(url, dim=4) as store:
        want = store.lookup(np.arange(50, dtype=np.int64))
    with embstore.open(url, read_only=True) as again:
        assert len(again) == 50
        assert np.array_equal(again.lookup(np.arange(50, dtype=np.int64), insert=False), want)


def check_backend(name: str, tmp: str) -> None:
    import embstore

    if name in ("lmdb", "rocksdb"):
        _roundtrip(f"{name}://{tmp}/{name}")
    elif name == "sql":
        _roundtrip(f"sqlite:///{tmp}/t.db")
    elif name == "parquet":
        path = os.path.join(tmp, "t.parquet")
        with embstore.open("memory://", dim=4) as store:
            store.lookup(list(range(20)))
            store.export(path)
        with embstore.open("memory://", dim=4) as copy:
            copy.import_(path)
            assert len(copy) == 20
    elif name == "bloom":
        admission = embstore.policies.BloomAdmission()
        with embstore.open("memory://", dim=4, admission=admission) as store:
            store.lookup(list(range(10)))
    elif name == "postgres":
        _server_roundtrip("postgres")
    elif name == "bigtable":
        _server_roundtrip("bigtable")
    else:
        raise SystemExit(f"unknown check {name!r}")


def _server_roundtrip(kind: str) -> None:
    try:
        if kind == "postgres":
            from embstore.testing.postgres import find_pg_bin, start_postgres

            find_pg_bin()
            server = start_postgres(settings={"fsync": "off"})
            url = server.url + "?table=check"
        else:
            from embstore.testing.bigtable_emulator import find_emulator, start_emulator

            find_emulator()
            server = start_emulator()
            os.environ["BIGTABLE_EMULATOR_HOST"] = server.host
            url = "bigtable://check/check/check"
    except FileNotFoundError:  # no server binaries here: the backend and its driver import
        from embstore.registry import backend_class

        backend_class("postgresql+psycopg://h/db" if kind == "postgres" else "bigtable://p/i/t")
        if kind == "postgres":
            import psycopg  # noqa: F401 - the driver SQLAlchemy loads on open
        print(f"install check {kind}: no server binaries here; the driver imports", flush=True)
        return
    try:
        _roundtrip(url)
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    block = "--block" in argv
    checks = [a for a in argv if a != "--block"]
    if block:
        sys.meta_path.insert(0, _Blocker())
    with tempfile.TemporaryDirectory() as tmp:
        for check in checks:
            if check == "core":
                check_core(tmp)
            elif check == "cli":
                check_cli_in_process() if block else check_cli()
            elif check == "missing":
                check_missing(tmp)
            else:
                check_backend(check, tmp)
            print(f"install check {check}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
