"""The declaration mechanism (icqs_fast/options.py) and the flags derived from it
(icqs_fast/cli/options.py): checks and their messages, defaults, argparse flags, tables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from icqs_fast.cli.options import add_declared, declared_values
from icqs_fast.options import check_declared, declaration, declared, option, options_table


@dataclass(frozen=True)
class Opts:
    count: int = option(8, ge=1, help="how many")
    ratio: float = option(0.5, gt=0, le=1, metavar="P", help="a fraction")
    mode: str = option("a", choices=("a", "b"), help="which")
    texts: tuple[str, ...] = option(("x", ""), flag="--text", help="texts")
    limit: int | None = option(None, kind="int", ge=1, help="a limit (none: no limit)")
    switch: bool = option(False, result=False, help="turn it on")
    hidden: str = option("h", flag=False, help="set in code only")

    def __post_init__(self) -> None:
        check_declared(self)


@pytest.mark.parametrize("kw, message", [
    ({"count": 0}, "--count must be an int >= 1, got 0"),
    ({"count": True}, "--count must be an int >= 1, got True"),
    ({"ratio": 0.0}, "--ratio must be a finite number in (0, 1], got 0.0"),
    ({"ratio": float("nan")}, "--ratio must be a finite number in (0, 1], got nan"),
    ({"mode": "c"}, "--mode must be one of 'a', 'b', got 'c'"),
    ({"texts": "x"}, "--text must be a non-empty list of str, got 'x'"),
    ({"limit": 0}, "--limit must be an int >= 1, got 0"),
    ({"switch": 1}, "--switch must be a bool, got 1"),
    ({"hidden": 3}, "hidden must be a str, got 3"),  # no flag: the field's name
])
def test_a_bad_value_is_refused_naming_the_flag(kw, message):
    with pytest.raises(ValueError) as info:
        Opts(**kw)
    assert str(info.value) == message


def test_values_are_normalised_and_defaults_read_back():
    o = Opts(ratio=1, texts=["y"], limit=None)
    assert o.ratio == 1.0 and isinstance(o.ratio, float) and o.texts == ("y",)
    assert [d.name for d in declared(Opts)] == ["count", "ratio", "mode", "texts", "limit",
                                                "switch", "hidden"]
    d = declaration(Opts, "texts")
    assert (d.flag, d.dest, d.default, d.option.kind) == ("--text", "text", ("x", ""), "strs")
    assert declaration(Opts, "hidden").flag is None


def test_flags_parse_back_into_the_class():
    p = argparse.ArgumentParser()
    add_declared(p, Opts)
    assert "--hidden" not in p.format_help()
    assert "a fraction (default 0.5)" in p.format_help()
    args = p.parse_args(["--count", "3", "--text", "u", "--text", "v", "--switch"])
    assert Opts(**declared_values(args, Opts)) == Opts(count=3, texts=("u", "v"), switch=True)
    # A repeated option given no time keeps the declared default.
    assert Opts(**declared_values(p.parse_args([]), Opts)) == Opts()
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])


def test_two_classes_with_a_field_of_one_name_keep_their_own_values():
    """ScoringSettings.seed (--seed) and SelfCheckOptions.seed (--self-check-seed) on one
    command line: each flag has its own dest, so neither overwrites the other."""
    from icqs_fast.cli.score import add_arguments, build_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    c = build_config(p.parse_args(["in.jsonl", "-o", "o.jsonl", "--good", "g", "--bad", "b",
                                   "--seed", "2", "--self-check-seed", "5"]))
    assert (c.scoring.seed, c.self_check.seed) == (2, 5)


def test_the_table_row_of_each_option():
    table = options_table(Opts)
    assert "| `--count N` | `8` | how many |" in table
    assert "| `--mode {a,b}` | `a` | which |" in table
    assert "| `--switch` |  | turn it on (not in the resume fingerprint) |" in table
    assert "hidden" not in table
