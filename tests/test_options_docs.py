"""docs/CLI.md's option tables are the ones the declarations generate
(:func:`icqs_fast.cli.options.options_docs`); after changing a declaration, regenerate them with
``.venv/bin/python -m icqs_fast.cli.options``."""

from __future__ import annotations

from pathlib import Path

from icqs_fast.cli.options import DOCS_BEGIN, DOCS_END, options_docs, write_options_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"


def test_cli_doc_tables_are_generated_from_the_declarations():
    text = DOC.read_text(encoding="utf-8")
    assert DOCS_BEGIN in text and DOCS_END in text
    current = DOCS_BEGIN + text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0] + DOCS_END
    assert current == options_docs(), (
        "docs/CLI.md's option tables are stale: run .venv/bin/python -m icqs_fast.cli.options")


def test_a_stale_table_is_rewritten(tmp_path):
    doc = tmp_path / "CLI.md"
    text = DOC.read_text(encoding="utf-8")
    doc.write_text(text.replace("| N: demonstrations per set |", "| an old help |"))
    assert write_options_docs(str(doc)) is True
    assert doc.read_text(encoding="utf-8") == text
    assert write_options_docs(str(doc)) is False  # up to date: left alone
