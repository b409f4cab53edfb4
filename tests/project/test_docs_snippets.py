"""Every fenced python/console block of README.md and docs/*.md runs as written.

The placeholder convention and the directives (skip with a reason, continue, hidden setup and
after code) are described in docs/writing-docs.md; the extraction is tests/docs_snippets.py.
Blocks run in this process (imports are paid once), each chain in a fresh temporary directory
that is also the working directory; servers come from the session fixtures when a block names
them.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.docs_snippets import (
    Block,
    SnippetSyntaxError,
    chains,
    extract,
    needs_bigtable,
    needs_postgres,
    substitute,
)

CHAINS = chains()


def _console(block: Block, text: str) -> None:
    """Run each ``$ `` line; ``embstore ...`` through the CLI's main in this process."""
    from embstore.cli import main

    for raw in text.split("\n"):
        if not raw.startswith("$ "):
            continue                    # output shown in the page
        for argv in _split_and(shlex.split(raw[2:], comments=True)):
            if argv[0] == "embstore":
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main(argv[1:])
                assert rc == 0, f"{block.id}: `{' '.join(argv)}` exited {rc}: {err.getvalue()}"
            else:
                res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, f"{block.id}: `{raw}`: {res.stderr}"


_RAISES = re.compile(r"^(?P<name>[A-Za-z_]\w*(Error|Exception|Warning))(: (?P<msg>.*))?$")


def _session(block: Block, text: str, namespace: dict) -> None:
    """An interactive ``>>>`` block: run each statement; a shown ``XError: msg`` must be raised.

    Other output lines are not compared (reprs of arrays and stats vary); an error line is, by
    the exception's class name and the message's first line.
    """
    statements: list[tuple[int, str, list[str]]] = []
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if raw.startswith(">>> "):
            statements.append((lineno, raw[4:], []))
        elif raw.startswith("... ") and statements:
            statements[-1] = (statements[-1][0], statements[-1][1] + "\n" + raw[4:],
                              statements[-1][2])
        elif statements and raw.strip():
            statements[-1][2].append(raw)
    for lineno, code, shown in statements:
        src = "\n" * (lineno - 1) + code
        m = _RAISES.match(shown[0]) if shown else None
        if m is None:
            exec(compile(src, block.page, "exec"), namespace)
            continue
        with pytest.raises(Exception) as info:
            exec(compile(src, block.page, "exec"), namespace)
        names = {c.__name__ for c in type(info.value).__mro__}
        assert m.group("name") in names, f"{block.id}:{lineno}: raised {info.value!r}"
        msg = (m.group("msg") or "").strip()
        assert msg in str(info.value), f"{block.id}:{lineno}: {str(info.value)!r} lacks {msg!r}"


def _split_and(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for a in argv:
        if a == "&&":
            out.append([])
        else:
            out[-1].append(a)
    return [a for a in out if a]


@pytest.mark.parametrize("chain", CHAINS, ids=[c[0].id for c in CHAINS])
def test_snippet(chain: list[Block], request, tmp_path, monkeypatch):
    skipped = [b for b in chain if b.skip]
    if skipped:
        pytest.skip(f"{skipped[0].id}: {skipped[0].skip}")
    every = "\n".join(b.code + "".join(b.setup) + "".join(b.after) for b in chain)
    host = url = None
    if needs_bigtable(every):
        host = request.getfixturevalue("bigtable_emulator").host
        monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", host)
    if needs_postgres(every):
        url = request.getfixturevalue("postgres_server").url
    for sub in ("data", "tmp", "serve"):
        (tmp_path / sub).mkdir()
    monkeypatch.chdir(tmp_path)
    sub_args = {"root": tmp_path, "bigtable_host": host, "postgres_url": url}
    namespace: dict = {"__name__": "__docs__"}
    level = logging.getLogger("embstore").level
    environ = dict(os.environ)   # hidden setup may set variables (torchrun's, for one)
    try:
        for block in chain:
            for code in block.setup:
                exec(compile(substitute(code, **sub_args), f"{block.id} (setup)", "exec"),
                     namespace)
            text = substitute(block.source(), **sub_args)
            if block.lang == "console":
                _console(block, text)
            elif block.code.lstrip().startswith(">>> "):
                _session(block, text, namespace)
            else:
                exec(compile(text, block.page, "exec"), namespace)
            for code in block.after:
                exec(compile(substitute(code, **sub_args), f"{block.id} (after)", "exec"),
                     namespace)
    finally:
        import embstore

        embstore.set_metrics_hook(None)
        os.environ.clear()
        os.environ.update(environ)
        logging.getLogger("embstore").setLevel(level)
        for value in list(namespace.values()):
            close = getattr(value, "close", None)
            if getattr(value, "__module__", "").startswith("embstore") and callable(close):
                with contextlib.suppress(Exception):
                    close()
        namespace.clear()
        gc.collect()


def test_every_page_has_runnable_blocks():
    """The runner finds the blocks (a broken extractor must not pass by running nothing)."""
    runnable = [b for c in CHAINS for b in c if not b.skip]
    assert len(runnable) >= 40
    assert {b.page for b in runnable} >= {"README.md", "docs/training.md", "docs/cli.md"}


def test_directive_errors_are_loud(tmp_path, monkeypatch):
    """A skip without a reason or a misspelt directive fails instead of skipping quietly."""
    import tests.docs_snippets as ds

    monkeypatch.setattr(ds, "ROOT", tmp_path)
    page = tmp_path / "p.md"
    page.write_text("<!-- snippet: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(SnippetSyntaxError, match="needs a reason"):
        extract(page)
    page.write_text("<!-- snippet: skp no -->\n```python\nx = 1\n```\n")
    with pytest.raises(SnippetSyntaxError, match="unknown directive"):
        extract(page)
    page.write_text("<!-- snippet: setup\ny = 2\n-->\n\n<!-- snippet: skip needs a GPU -->\n"
                    "```python\nx = y\n```\n")
    (block,) = extract(page)
    assert block.setup == ["y = 2"] and block.skip == "needs a GPU"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
