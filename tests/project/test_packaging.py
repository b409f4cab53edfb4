"""Packaging: the license text, the wheel's contents (no generated C), the TF extras."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = str(REPO_ROOT)


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_license_file_is_the_apache_2_text():
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        text = f.read()
    # the md5 of the canonical LICENSE-2.0.txt from apache.org
    assert hashlib.md5(text).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"
    meta = _pyproject()["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert meta["classifiers"] and meta["keywords"]


def test_tf_extras_do_not_force_one_tensorflow_distribution():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["tf"] == ["tensorflow>=2.16"]
    assert extras["tf-cpu"] == ["tensorflow-cpu>=2.16"]
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert ".[all,torch,tf-cpu,test]" in f.read()  # the dev venv keeps tensorflow-cpu


def test_build_py_leaves_generated_c_out(tmp_path):
    # build_py decides the wheel's pure files (package data); it compiles nothing
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    files = [os.path.relpath(os.path.join(d, f), tmp_path)
             for d, _, fs in os.walk(tmp_path) for f in fs]
    assert not [f for f in files if f.endswith(".c")]
    assert "embstore/_cython/cuckoo.pyi" in files and "embstore/py.typed" in files
    assert "embstore_tf/serving.py" in files
    assert "embstore_tf/native/embstore_ops.cc" in files  # built on first use


def test_install_hints_name_a_command_that_works_from_a_checkout():
    """embstore is not on PyPI: ``pip install 'embstore[x]'`` finds no distribution, so every
    hint in the code and the docs is the editable checkout form and names a real extra."""
    import re

    extras = set(_pyproject()["project"]["optional-dependencies"])
    texts = []
    for base in ("embstore", "adapters", "docs"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            texts += [os.path.join(dirpath, f) for f in files if f.endswith((".py", ".md"))]
    texts.append(os.path.join(ROOT, "README.md"))
    named = set()
    for path in texts:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert "pip install 'embstore[" not in text, path
        named |= set(re.findall(r"pip install -e '\.\[([\w-]+)\]'", text))
    named.discard("extra")  # the generic form in prose: pip install -e '.[extra]'
    assert named and named <= extras, named - extras


def test_missing_backend_dependency_names_the_checkout_command():
    import embstore
    from embstore import registry
    from embstore.errors import BackendUnavailableError

    registry.register_backend("nodep", "embstore_no_such_module:Backend", extra="lmdb")
    try:
        with pytest.raises(BackendUnavailableError, match=r"pip install -e '\.\[lmdb\]'"):
            embstore.open("nodep://x", dim=4)
    finally:
        registry._registry.pop("nodep", None)


def test_readme_is_short_and_links_every_docs_page():
    """The README is the five-minute read (at most 200 lines) and every page in docs/ is
    reachable from it; reference material lives in docs/."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.splitlines()) <= 200
    pages = {f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")}
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert pages <= linked, sorted(pages - linked)
