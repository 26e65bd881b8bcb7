"""Ground truth for the audit: a human label field, or a regular-expression match of the
generator's response against a correct-answer field (the two ways the ALLURE study had it).

A truth is always one of the task's option strings (e.g. ``"1"`` for "the response is correct"),
so it compares directly with the evaluator's label.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Mapping
from typing import Any

NORMALISERS = ("lower", "strip", "space", "punct", "nfkc")
"""Steps :func:`normalise` knows, applied in the order given."""

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalise(text: str, steps: tuple[str, ...] | list[str] = ("lower", "space", "strip")) -> str:
    """``text`` after each normalisation step, in order: ``lower`` (casefold), ``strip`` (outer
    whitespace), ``space`` (runs of whitespace -> one space), ``punct`` (ASCII punctuation
    removed), ``nfkc`` (Unicode NFKC)."""
    for s in steps:
        if s == "lower":
            text = text.casefold()
        elif s == "strip":
            text = text.strip()
        elif s == "space":
            text = re.sub(r"\s+", " ", text)
        elif s == "punct":
            text = _PUNCT.sub("", text)
        elif s == "nfkc":
            text = unicodedata.normalize("NFKC", text)
        else:
            raise ValueError(f"unknown normalisation step {s!r}; use some of {NORMALISERS}")
    return text


def regex_truth(response: str, answer: str, *, pattern: str = r"(?<!\w){answer}(?!\w)",
                normalisers: tuple[str, ...] | list[str] = ("lower", "space", "strip"),
                correct: str = "1", incorrect: str = "0") -> str:
    """``correct`` when the normalised ``response`` matches ``pattern`` with ``{answer}``
    replaced by the escaped, normalised ``answer``, else ``incorrect``.

    The default pattern finds the answer as a whole word anywhere in the response (``"42"``
    matches ``"the answer is 42."`` but not ``"420"``); ``r"^{answer}$"`` asks for an exact
    match, ``r"answer is {answer}\\b"`` for a stated final answer.

    Raises:
        ValueError: a pattern without ``{answer}``, or not a valid regular expression.
    """
    if "{answer}" not in pattern:
        raise ValueError(f"the truth pattern must contain {{answer}}, got {pattern!r}")
    ans = re.escape(normalise(answer, normalisers))
    rx = pattern.replace("{answer}", ans)
    try:
        found = re.search(rx, normalise(response, normalisers)) is not None
    except re.error as exc:
        raise ValueError(f"bad truth pattern {pattern!r}: {exc}") from None
    return correct if found else incorrect


def label_truth(value: Any, options: tuple[str, ...] | list[str],
                mapping: Mapping[str, str] | None = None) -> str:
    """The option a human label stands for: ``mapping[str(value)]`` when a mapping is given,
    else ``str(value)`` itself (an int 1 and the string "1" are the same label; a float 1.0 is
    read as "1").

    Raises:
        ValueError: the label is not one of the options (after mapping); the message names it.
    """
    if isinstance(value, bool):
        key = "1" if value else "0"
    elif isinstance(value, float) and value.is_integer():
        key = str(int(value))
    else:
        key = str(value).strip()
    if mapping is not None:
        if key not in mapping:
            raise ValueError(f"label {value!r} is not in the label mapping ({sorted(mapping)})")
        key = mapping[key]
    if key not in options:
        raise ValueError(f"label {value!r} is not one of the options {list(options)}")
    return key
