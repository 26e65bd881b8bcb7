"""The README and docs/ against the code: every ``icqs-fast COMMAND ... --flag`` written there is
a flag of that command, every docs page the README links exists, and the README stays short."""

import argparse
import re
from functools import cache
from pathlib import Path

import pytest

from icqs_fast.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATHS = {tuple(name.split()) for name in COMMANDS}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")
# A command line ends where prose or a table cell starts again.
ENDS = re.compile(r"`|\|(?!\|)\s|\s\|\s|;|\.\s|, then ")


@cache
def flags_of(path: tuple[str, ...]) -> frozenset[str]:
    parser = build_parser(list(path))
    for word in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[word]
    return frozenset(s for a in parser._actions for s in a.option_strings)


def _command_lines(text: str):
    """(command path, the rest of its command line) for every ``icqs-fast ...`` written in
    ``text``: code blocks with their backslash continuations joined, and inline code spans."""
    joined = re.sub(r"\\\n\s*", " ", text)
    for m in re.finditer(r"icqs-fast ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)", joined):
        words = tuple(m.group(1).split())
        path = words if words in PATHS else words[:1] if words[:1] in PATHS else None
        if path is None:
            continue
        rest = joined[m.start() + len("icqs-fast "):]
        rest = rest.split("\n", 1)[0]
        rest = ENDS.split(rest, 1)[0]
        yield path, rest


def _documented_flags():
    out = []
    for page in PAGES:
        for path, rest in _command_lines(page.read_text(encoding="utf-8")):
            out.extend((page.name, path, flag) for flag in FLAG.findall(rest))
    return out


def test_the_check_sees_the_documented_command_lines():
    """The scan is not empty and sees what the pages say (a scanner that found nothing
    would pass anything)."""
    found = _documented_flags()
    assert len(found) > 50
    assert ("README.md", ("score",), "--good") in found
    assert any(p == ("serve",) for _, p, _ in found)
    assert ("x", ("score",), "--no-such-flag") not in found


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_every_documented_flag_exists(page):
    bad = sorted({f"icqs-fast {' '.join(path)} {flag}" for name, path, flag in _documented_flags()
                  if name == page and flag not in flags_of(path) and flag != "--help"})
    assert not bad, f"{page} documents flags the commands do not have: {bad}"


def test_readme_links_exist_and_it_stays_short():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = set(re.findall(r"docs/[A-Za-z_]+\.md", text))
    assert links, "the README links its docs pages"
    assert not [p for p in links if not (ROOT / p).exists()]
    assert len(text.splitlines()) <= 220, "the README is the two-minute read; details go to docs/"


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_server_limits_table_lists_every_limit_flag():
    """The README's *Server limits* names every limit flag of ``serve`` (each ``--max-*`` and
    ``*-timeout`` flag, the API key), and every flag there or in docs/SERVER.md is a ``serve``
    flag."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    limits = _section(readme, "Server limits")
    serve = flags_of(("serve",))
    named = set(FLAG.findall(limits))
    wanted = {f for f in serve if f.startswith("--max-") or f.endswith("-timeout")} | {
        "--api-key"}
    assert not wanted - named, f"limits missing from the README table: {sorted(wanted - named)}"
    server_doc = (ROOT / "docs" / "SERVER.md").read_text(encoding="utf-8")
    # Other programs' command lines there (lm_eval's, `bench serve ...`) have their own flags.
    prose = re.sub(r"`bench serve[^`]*`", "", "\n".join(
        line for line in server_doc.splitlines() if "lm_eval" not in line))
    unknown = (named | set(FLAG.findall(prose))) - serve
    assert not unknown, f"flags that serve does not have: {sorted(unknown)}"
