"""`import embstore` and memory:// need only numpy and tqdm: each backend's driver is imported
when that backend is opened, and a missing one raises BackendUnavailableError naming the backend
and its extra. ``tests/install_check.py`` runs the checks in a child process; ``make
check-install`` runs the same script in fresh venvs installed from the wheel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

ROOT = str(REPO_ROOT)
CHECK = os.path.join(ROOT, "tests", "install_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [ROOT, os.path.join(ROOT, "adapters", "torch"), os.path.join(ROOT, "adapters", "tf")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, CHECK, *args], cwd=os.path.dirname(ROOT), env=env,
                          capture_output=True, text=True, timeout=240)


def test_quick_start_cli_and_missing_driver_errors_with_every_driver_unimportable():
    """As in a venv without extras: lmdb, rocksdict, SQLAlchemy, psycopg, google, grpc, pyarrow,
    pybloom-live, torch and tensorflow raise ImportError on import."""
    run = _run("--block", "core", "cli", "missing")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "install check missing: ok" in run.stdout


def test_memory_quick_start_loads_no_driver_even_where_all_are_installed():
    # installed drivers would make an eager import succeed silently (and cost seconds: torch)
    run = _run("core", "cli")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_install_hints_name_the_requirements_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    from embstore.extras import EXTRAS, install_hint

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]
    for extra, reqs in EXTRAS.items():
        assert list(reqs) == declared[extra], extra
        assert f"pip install -e '.[{extra}]'" in install_hint(extra)


def test_a_missing_driver_is_named_for_the_backend_asked_for(tmp_path):
    from embstore import registry
    from embstore.errors import BackendUnavailableError

    registry.register_backend("nodriver", "embstore_no_such_driver:Backend", extra="rocksdb")
    try:
        with pytest.raises(BackendUnavailableError) as info:
            import embstore

            embstore.open(f"nodriver://{tmp_path}/x", dim=4)
    finally:
        registry._registry.pop("nodriver", None)
    msg = str(info.value)
    assert "the 'nodriver' backend" in msg and "'embstore_no_such_driver'" in msg
    assert "pip install -e '.[rocksdb]'" in msg and "'rocksdict>=0.3.20'" in msg
