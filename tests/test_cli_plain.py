"""Plain user text on the command line (issue 40, item 4): no Sphinx markup in any command's
``--help``, a misspelled flag answered with that command's own usage (exit 2), and a demo that
says what a score is."""

import re

import pytest

from icqs_fast.cli import COMMANDS, build_parser, main, plain_text

MARKUP = re.compile(r":[a-z]+(?::[a-z]+)?:`|``")


def test_plain_text_drops_sphinx_roles_and_double_backticks():
    assert plain_text(":class:`~icqs_fast.jobs.config.ScoreJobConfig` and ``--x``") == (
        "ScoreJobConfig and --x")
    assert plain_text("see :func:`icqs_fast.jobs.runner.run_job`") == (
        "see icqs_fast.jobs.runner.run_job")
    assert plain_text(":ref:`the table <tbl>` `--x`") == "the table `--x`"
    assert plain_text(None) is None


@pytest.mark.parametrize("path", [tuple(n.split()) for n in COMMANDS],
                         ids=" ".join)
def test_no_sphinx_markup_in_any_help(path):
    parser = build_parser([*path])
    text = parser.commands[path].format_help()
    assert not MARKUP.search(text), f"{' '.join(path)} --help: {MARKUP.search(text)[0]!r}"
    assert path[-1] in text.splitlines()[0]  # its own usage line


def test_top_level_help_is_plain():
    assert not MARKUP.search(build_parser().format_help())


def test_a_misspelled_flag_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "out.jsonl", "--baseline-run", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: icqs-fast report ")
    assert "icqs-fast report: error: unrecognized arguments: --baseline-run x" in err
    with pytest.raises(SystemExit) as exc:  # a command two words deep
        main(["bench", "kernels", "--no-such-flag"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("usage: icqs-fast bench kernels ")


@pytest.mark.usefixtures("one_torch_thread")
def test_demo_says_what_a_score_is(tiny_llama_dir, capsys):
    rc = main(["demo", "--model", str(tiny_llama_dir()), "--num-ratios", "3",
               "--sets-per-ratio", "1", "--demos-per-set", "2", "--threads", "1",
               "--self-check-max", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "A score is the share (its posterior mean) of good demonstrations, in [0, 1]" in out
    assert "not a probability" in out
