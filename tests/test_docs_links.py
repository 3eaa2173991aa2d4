"""The user-facing documents (issue 54): every relative link and every repository path
they name exists, and their size bounds hold (README.md, docs/ROUTER.md,
docs/SECURITY.md, docs/ as a whole without ARCHITECTURE.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHECKED = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "deploy" / "README.md",
                  *DOCS.glob("*.md")])
#: path-like words that name no file: kubectl's deploy/NAME (a Deployment); the folder
#: the GPU check writes its first results to
NOT_PATHS = {"deploy/kvpush-decode", "benchmarks/results/gpu/"}

#: markdown links [text](target); targets with a scheme or only an anchor are skipped
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: a path under one of the repository's top-level folders, or a ../ path, in any text
#: (not after a colon: `git show REV:PATH` names a file of another commit)
TOP = "src|tests|docs|benchmarks|scripts|deploy|\\.ci"
PATH = re.compile(rf"(?<![\w./:-])((?:\.\./)+[\w./-]+|(?:{TOP})/[\w./*-]*)")
#: a backticked file name such as `RESULTS.md`, `Makefile`, `requirements.txt`: it must
#: be at the root or beside the document
TOP_FILE = re.compile(r"`([A-Z][\w.-]*\.md|requirements[\w-]*\.txt|pyproject\.toml|Makefile)`")
#: a backticked module path inside the package (`router/decide.py`)
MODULE = re.compile(r"`([a-z_]+/[\w/]*\.py)")
PACKAGE = ROOT / "src" / "kvpush"


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def named_paths(doc: Path) -> set[str]:
    """Repository paths a document names, as written (a trailing `:NAME` dropped)."""
    text = doc.read_text()
    found = {m.group(1) for m in PATH.finditer(text)}
    found |= {m.group(1) for m in TOP_FILE.finditer(text)}
    found |= {m.group(1) for m in MODULE.finditer(text)}
    out = set()
    for p in found:
        p = p.rstrip(".,;:").split(":")[0]
        if p and p not in NOT_PATHS and not any(c in p for c in "*<>{}"):
            out.add(p)
    return out


def resolves(doc: Path, target: str) -> bool:
    """A path resolves from the repository root or the document's folder and stays
    inside the repository; a module path may also be the tail of one in the package
    (`transports/transport.py` in a section on kv_transfer)."""
    for base in (ROOT, doc.parent):
        p = (base / target).resolve()
        if p.is_relative_to(ROOT) and p.exists():
            return True
    return target.endswith(".py") and next(PACKAGE.glob(f"**/{target}"), None) is not None


@pytest.mark.parametrize("doc", CHECKED, ids=rel)
def test_every_named_path_exists(doc: Path) -> None:
    if not doc.exists():
        pytest.skip(f"{rel(doc)} is not there")
    missing = sorted(p for p in named_paths(doc) if not resolves(doc, p))
    assert not missing, f"{rel(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", CHECKED, ids=rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    if not doc.exists():
        pytest.skip(f"{rel(doc)} is not there")
    bad = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # an anchor in the same file, or http:, https:, mailto:
        p = (doc.parent / target).resolve()
        if not (p.is_relative_to(ROOT) and p.exists()):
            bad.append(m.group(1))
    assert not bad, f"{rel(doc)} links to what does not exist: {bad}"


def test_the_paths_are_found() -> None:
    """The patterns above see the paths the documents name (a check of the check)."""
    names = named_paths(ROOT / "README.md")
    assert "CONTRIBUTING.md" in names or any(n.startswith("docs/") for n in names)


def size(p: Path) -> int:
    return len(p.read_bytes())


def test_size_bounds() -> None:
    assert size(ROOT / "README.md") <= 6_000
    assert size(DOCS / "ROUTER.md") <= 25_000
    assert size(DOCS / "SECURITY.md") <= 20_000
    rest = {rel(p): size(p) for p in DOCS.rglob("*")
            if p.is_file() and p.name != "ARCHITECTURE.md"}
    assert sum(rest.values()) <= 120_000, rest


def test_docs_index_names_every_file() -> None:
    index = (DOCS / "README.md").read_text()
    unlisted = [p.name for p in DOCS.glob("*.md") if p.name != "README.md"
                and p.name not in index]
    assert not unlisted, f"docs/README.md does not say who reads {unlisted}"


@pytest.mark.parametrize("doc", sorted(DOCS.glob("*.md")), ids=rel)
def test_each_doc_opens_with_a_summary(doc: Path) -> None:
    """A title, then a paragraph of prose before any section, table or code."""
    lines = doc.read_text().splitlines()
    assert lines[0].startswith("# "), rel(doc)
    first = next(line for line in lines[1:] if line.strip())
    assert not first.startswith(("#", "|", "```", "-")), f"{rel(doc)}: {first!r}"


def kvpush_commands(doc: Path) -> list[list[str]]:
    """The `kvpush ...` command lines of a document's shell blocks, comments dropped and
    continuation lines joined."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["kvpush"] and "--help" not in words:
                out.append(words[1:])
    return out


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_the_commands_shown_parse(name: str) -> None:
    """Every flag a command line in README.md or CONTRIBUTING.md names exists."""
    from kvpush.cli import build_parser

    cmds = kvpush_commands(ROOT / name)
    assert cmds, name
    for argv in cmds:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: `kvpush {' '.join(argv)}` does not parse")
