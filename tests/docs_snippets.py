"""Extract the runnable code blocks of README.md and docs/*.md (see docs/writing-docs.md).

Every fenced ``python`` and ``console`` block is a test case. HTML comments directly above a
block (blank lines allowed between them) steer it:

``<!-- snippet: skip REASON -->``
    not run; the reason is required (a GPU, a multi-process launcher, a paid service...).
``<!-- snippet: continue -->``
    runs in the namespace and temporary directory of the previous block of the same page.
``<!-- snippet: setup`` + code lines + ``-->``
    hidden code run before the block (defines the names a fragment uses).
``<!-- snippet: after`` + code lines + ``-->``
    hidden code run after the block (closes what it opened, checks what it claims).

``bash``/``sh`` blocks are recipes (make, pip) and are not collected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_LANGUAGES = ("python", "console")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>[\w-]+)(?P<rest>.*)$")


class SnippetSyntaxError(ValueError):
    """A directive comment the runner does not understand (a typo must not skip a block)."""


@dataclass
class Block:
    """One fenced block and the directives above it."""

    page: str
    line: int                 # 1-based line of the opening fence
    lang: str
    code: str                 # dedented body; python keeps its line numbers (see ``source``)
    skip: str | None = None
    cont: bool = False
    setup: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def source(self) -> str:
        """The code padded with blank lines so tracebacks point at the page's own lines."""
        return "\n" * self.line + self.code


def _directives(lines: list[str], fence: int, page: str) -> tuple[dict, list[str], list[str]]:
    """Read the HTML comments directly above line index ``fence``."""
    opts: dict = {}
    setup: list[str] = []
    after: list[str] = []
    i = fence - 1
    comments: list[tuple[int, int]] = []
    while i >= 0:
        if not lines[i].strip():
            i -= 1
            continue
        if lines[i].rstrip().endswith("-->"):
            end = i
            while i >= 0 and "<!--" not in lines[i]:
                i -= 1
            if i < 0:
                break
            comments.append((i, end))
            i -= 1
            continue
        break
    for start, end in reversed(comments):
        m = _DIRECTIVE.match(lines[start])
        if m is None:
            continue                      # an ordinary comment
        kind, rest = m.group("kind"), m.group("rest")
        if start == end:
            rest = rest.rsplit("-->", 1)[0]
        rest = rest.strip()
        body = "\n".join(lines[start + 1:end]) if end > start else ""
        if end > start and lines[end].strip() != "-->":
            raise SnippetSyntaxError(f"{page}:{end + 1}: end a multi-line directive with a "
                                     "line holding only '-->'")
        if kind == "skip":
            if not rest:
                raise SnippetSyntaxError(f"{page}:{start + 1}: 'snippet: skip' needs a reason")
            opts["skip"] = rest
        elif kind == "continue":
            opts["cont"] = True
        elif kind in ("setup", "after"):
            (setup if kind == "setup" else after).append(_dedent(body))
        else:
            raise SnippetSyntaxError(f"{page}:{start + 1}: unknown directive 'snippet: {kind}' "
                                     "(skip, continue, setup, after)")
    return opts, setup, after


def _dedent(text: str) -> str:
    lines = text.split("\n")
    width = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return "\n".join(x[width:] for x in lines)


def extract(path: Path) -> list[Block]:
    """Every ``python``/``console`` block of one Markdown file, in page order."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None or not m.group("lang"):
            i += 1
            continue
        indent, lang = len(m.group("indent")), m.group("lang")
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        if lang in RUN_LANGUAGES:
            body = "\n".join(x[indent:] for x in lines[i + 1:j])
            opts, setup, after = _directives(lines, i, page)
            blocks.append(Block(page, i + 1, lang, body, setup=setup, after=after, **opts))
        i = j + 1
    return blocks


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def chains() -> list[list[Block]]:
    """Blocks grouped so that a ``continue`` block runs after the ones it continues."""
    out: list[list[Block]] = []
    for path in doc_pages():
        for block in extract(path):
            if block.cont and out and out[-1][0].page == block.page:
                out[-1].append(block)
            else:
                out.append([block])
    return out


_PATH = re.compile(r"(?<![\w.~])/(data|tmp|serve)/")
_PG = re.compile(r"postgresql\+psycopg://user@127\.0\.0\.1:5432/\w+")


def substitute(text: str, *, root: Path, bigtable_host: str | None, postgres_url: str | None
               ) -> str:
    """Apply the placeholder convention (docs/writing-docs.md) to a block's text."""
    text = _PATH.sub(lambda m: f"{root}/{m.group(1)}/", text)
    if bigtable_host:
        text = text.replace("127.0.0.1:8086", bigtable_host)
    if postgres_url:
        text = _PG.sub(postgres_url, text)
    return text


def needs_bigtable(text: str) -> bool:
    return "bigtable://" in text


def needs_postgres(text: str) -> bool:
    return _PG.search(text) is not None
