"""Prompt templates and demonstration sets for ICQS / ICQS-Epistemic.

A demonstration set for ratio ``r`` holds ``N`` (x, y) examples, a fraction ``r`` of them drawn
from the good pool and the rest from the bad pool. The prompt for a response (x, y) is

    system + demo(x_1, y_1) + separator + ... + demo(x_N, y_N) + separator   <- prefix (cached)
    + query(x)                                                               <- query
    + response(y)                                                            <- scored tokens

and the three parts are tokenised separately so the response's ids never depend on the demos.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Example = tuple[str, str]

_FIELD = re.compile(r"\{([xy])\}")


def _fill(fmt: str, **values: str) -> str:
    # One pass, so a "{y}" inside x is kept as text rather than substituted again.
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), fmt)


@dataclass(frozen=True)
class Template:
    """Text formats of the prompt parts; ``{x}`` and ``{y}`` are replaced by the example's fields.

    Attributes:
        demo: one demonstration, e.g. ``"Sentence: {x}\\nAnswer: {y}\\n"``.
        query: the scored example's prefix, e.g. ``"Sentence: {x}\\nAnswer:"`` (needs ``{x}``).
        response: the scored text, e.g. ``" {y}\\n"`` (needs ``{y}``); its tokens are scored.
        separator: text after each demonstration (between demos and before the query).
        system: optional text at the very start of the prompt (an instruction).
    """

    demo: str = "Sentence: {x}\nAnswer: {y}\n"
    query: str = "Sentence: {x}\nAnswer:"
    response: str = " {y}\n"
    separator: str = "\n"
    system: str = ""

    def __post_init__(self) -> None:
        for name in ("demo", "query", "response", "separator", "system"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Template.{name} must be a str, got {type(getattr(self, name))}")
        if "{y}" not in self.response:
            raise ValueError(f"Template.response must contain '{{y}}', got {self.response!r}")
        if "{x}" not in self.query:
            raise ValueError(f"Template.query must contain '{{x}}', got {self.query!r}")

    @classmethod
    def from_chat_template(cls, tokenizer: Any, system: str | None = None) -> Template:
        """A template that lays the prompt out as a chat in ``tokenizer``'s chat template: each
        demonstration is a user turn ``x`` and an assistant turn ``y``, the query is a user turn
        ``x`` plus the assistant header, and the response is ``y`` with the end of its turn.

        Args:
            tokenizer: a Hugging Face tokenizer with a chat template.
            system: system message text; None keeps whatever the chat template puts there by
                default (e.g. SmolLM2's default system prompt), "" too when it adds none.

        Raises:
            ValueError: the tokenizer has no chat template, or its layout can't be split into
                per-turn formats (e.g. a template that rewrites earlier turns).
        """
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template; use the plain "
                             "Template() or pass explicit formats")
        # Marker words a template will not trim or escape; rendered, then split around.
        x1, y1, x2, y2 = "ICQSMARKXONE", "ICQSMARKYONE", "ICQSMARKXTWO", "ICQSMARKYTWO"
        msgs = [] if system is None else [{"role": "system", "content": system}]
        msgs += [{"role": "user", "content": x1}, {"role": "assistant", "content": y1},
                 {"role": "user", "content": x2}, {"role": "assistant", "content": y2}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        try:
            i_x1, i_y1, i_x2, i_y2 = (text.index(m) for m in (x1, y1, x2, y2))
        except ValueError:
            raise ValueError("the chat template dropped a message; it can't be used for "
                             "demonstrations") from None
        before = text[:i_x1]
        mid = text[i_x1 + len(x1):i_y1]  # end of the user turn + assistant header
        between = text[i_y1 + len(y1):i_x2]  # end of the assistant turn + user header
        if text[i_x2 + len(x2):i_y2] != mid:
            raise ValueError("the chat template formats the two user turns differently")
        tail = text[i_y2 + len(y2):]
        end = between if not tail else tail
        if not between.startswith(end):
            raise ValueError("the chat template ends assistant turns differently; it can't be "
                             "split into per-turn formats")
        user_head = between[len(end):]
        if not before.endswith(user_head):
            raise ValueError("the chat template formats the first user turn differently")
        sys_text = before[: len(before) - len(user_head)]
        bos = getattr(tokenizer, "bos_token", None)
        if bos and sys_text.startswith(bos) and adds_bos(tokenizer):
            sys_text = sys_text[len(bos):]  # the engine adds BOS as an id, like the tokenizer
        return cls(demo=user_head + "{x}" + mid + "{y}" + end, query=user_head + "{x}" + mid,
                   response="{y}" + end, separator="", system=sys_text)

    def format_demo(self, x: str, y: str) -> str:
        """One demonstration's text (followed by nothing; the separator is added by the prefix)."""
        return _fill(self.demo, x=x, y=y)

    def format_prefix(self, demos: Sequence[Example]) -> str:
        """The cached part: ``system`` then every demonstration followed by ``separator``."""
        return self.system + "".join(self.format_demo(x, y) + self.separator for x, y in demos)

    def format_query(self, x: str) -> str:
        """The scored example's prompt part (after the demonstrations)."""
        return _fill(self.query, x=x)

    def format_response(self, y: str) -> str:
        """The scored text."""
        return _fill(self.response, y=y)


@dataclass(frozen=True)
class DemoSet:
    """One demonstration set: its ratio, the chosen examples in prompt order, and which are good.

    Attributes:
        ratio: the nominal fraction of good demonstrations, ``j / M``.
        examples: the ``N`` (x, y) pairs in prompt order.
        is_good: ``N`` bools, True where the example came from the good pool.
        ratio_index: ``j``; set_index: ``l`` (which of the L sets of this ratio).
    """

    ratio: float
    examples: tuple[Example, ...]
    is_good: tuple[bool, ...]
    ratio_index: int = 0
    set_index: int = 0

    @property
    def n_good(self) -> int:
        return sum(self.is_good)


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer prepends its BOS token when encoding text (the engine then puts
    BOS, as an id, before each demonstration prefix)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = tokenizer("a")["input_ids"]
    return len(probe) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) and \
        probe[0] == bos


def _check_pool(pool: Sequence, name: str) -> list[Example]:
    out: list[Example] = []
    for i, ex in enumerate(pool):
        if isinstance(ex, dict):
            if "x" not in ex or "y" not in ex:
                raise ValueError(f"{name}[{i}]: a dict example needs keys 'x' and 'y'")
            x, y = ex["x"], ex["y"]
        else:
            try:
                x, y = ex
            except (TypeError, ValueError):
                raise TypeError(
                    f"{name}[{i}]: expected an (x, y) pair or a dict, got {ex!r}"
                ) from None
        for fname, v in (("x", x), ("y", y)):
            if not isinstance(v, str):
                raise TypeError(f"{name}[{i}].{fname} must be a str, got {type(v).__name__}")
        out.append((x, y))
    return out


def build_demo_sets(
    good: Sequence[Example],
    bad: Sequence[Example],
    *,
    num_ratios: int = 5,
    demos_per_set: int = 8,
    sets_per_ratio: int = 4,
    seed: int = 0,
    mixing: str = "exact",
    replacement: bool = False,
) -> list[list[DemoSet]]:
    """Seeded demonstration sets for ratios ``r_j = j / M``, ``j = 0..M`` (``M + 1 = num_ratios``).

    Args:
        good, bad: pools of (x, y) str pairs (or dicts with "x"/"y").
        num_ratios: ``M + 1 >= 2``.
        demos_per_set: ``N >= 1`` demonstrations per set.
        sets_per_ratio: ``L >= 1`` sets per ratio.
        seed: everything is deterministic given the seed.
        mixing: ``"exact"``: ``round(r * N)`` good demos, in shuffled order; ``"bernoulli"``: each
            demo is good with probability ``r``.
        replacement: draw examples with replacement (a set may then repeat an example); without
            it each set holds distinct examples, so each pool needs as many as a set may draw.

    Returns:
        ``sets[j][l]``: a :class:`DemoSet`, ``j`` in ``0..M``, ``l`` in ``0..L-1``.

    Raises:
        ValueError: bad sizes, unknown mixing, or a pool too small for ``N`` without replacement.
    """
    for name, v, lo in (("num_ratios", num_ratios, 2), ("demos_per_set", demos_per_set, 1),
                        ("sets_per_ratio", sets_per_ratio, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if mixing not in ("exact", "bernoulli"):
        raise ValueError(f"mixing must be 'exact' or 'bernoulli', got {mixing!r}")
    g = _check_pool(good, "good")
    b = _check_pool(bad, "bad")
    n = demos_per_set
    # The pure ratios (r=1, r=0) need N of one pool whatever the mixing.
    if not g or not b or (not replacement and (len(g) < n or len(b) < n)):
        raise ValueError(
            f"too few examples for demos_per_set={n}: {len(g)} good and {len(b)} bad "
            f"(each pool needs at least {n if not replacement else 1}"
            + ("" if replacement else "; or pass replacement=True") + ")"
        )
    m = num_ratios - 1
    rng = random.Random(seed)
    sets: list[list[DemoSet]] = []
    for j in range(num_ratios):
        r = j / m
        row = []
        for li in range(sets_per_ratio):
            if mixing == "exact":
                n_good = int(math.floor(r * n + 0.5))  # round half up, unlike Python's round()
                flags = [True] * n_good + [False] * (n - n_good)
                rng.shuffle(flags)
            else:
                flags = [rng.random() < r for _ in range(n)]
            k = sum(flags)
            if replacement:
                gi = [rng.randrange(len(g)) for _ in range(k)]
                bi = [rng.randrange(len(b)) for _ in range(n - k)]
            else:
                gi = rng.sample(range(len(g)), k)
                bi = rng.sample(range(len(b)), n - k)
            it_g, it_b = iter(gi), iter(bi)
            examples = tuple(g[next(it_g)] if f else b[next(it_b)] for f in flags)
            row.append(DemoSet(ratio=r, examples=examples, is_good=tuple(flags),
                               ratio_index=j, set_index=li))
        sets.append(row)
    return sets
