"""Prompt templates and demonstration sets for ICQS / ICQS-Epistemic.

A demonstration set for ratio ``r`` holds ``N`` (x, y) examples, a fraction ``r`` of them drawn
from the good pool and the rest from the bad pool. The prompt for a response (x, y) is

    system + demo(x_1, y_1) + separator + ... + demo(x_N, y_N) + separator   <- prefix (cached)
    + query(x)                                                               <- query
    + response(y)                                                            <- scored tokens

and the prompt is tokenised as one string (as a plain forward over the text would be); the
engine finds the response's tokens by character offsets and caches each prefix up to a token
boundary the whole text shares (see :class:`icqs_fast.engine.prompt_tokens.PromptTokens`).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Example = tuple[str, str]

_FIELD = re.compile(r"\{([xy])\}")


def fill_template(fmt: str, **values: str) -> str:
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
    def from_chat_template(cls, tokenizer: PreTrainedTokenizerBase,
                           system: str | None = None) -> Template:
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
        return fill_template(self.demo, x=x, y=y)

    def format_prefix(self, demos: Sequence[Example]) -> str:
        """The cached part: ``system`` then every demonstration followed by ``separator``."""
        return self.system + "".join(self.format_demo(x, y) + self.separator for x, y in demos)

    def format_query(self, x: str) -> str:
        """The scored example's prompt part (after the demonstrations)."""
        return fill_template(self.query, x=x)

    def format_response(self, y: str) -> str:
        """The scored text."""
        return fill_template(self.response, y=y)


@dataclass(frozen=True)
class DemoSet:
    """One demonstration set: its ratio, the chosen examples in prompt order, and which are good.

    Attributes:
        ratio: the nominal fraction of good demonstrations, ``j / M``.
        examples: the ``N`` (x, y) pairs in prompt order.
        is_good: ``N`` bools, True where the example came from the good pool.
        ratio_index: ``j``; set_index: ``l`` (which of the L sets of this ratio).
        strata: ``N`` stratum names, one per example, when the set was drawn stratified
            (``build_demo_sets(stratify=...)``); None otherwise.
    """

    ratio: float
    examples: tuple[Example, ...]
    is_good: tuple[bool, ...]
    ratio_index: int = 0
    set_index: int = 0
    strata: tuple[str, ...] | None = None

    @property
    def n_good(self) -> int:
        return sum(self.is_good)


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer prepends its BOS token when encoding text (the engine then puts
    BOS, as an id, before each demonstration prefix)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = tokenizer("a")["input_ids"]
    return len(probe) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) and \
        probe[0] == bos


def check_pool(pool: Sequence, name: str) -> list[Example]:
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


class TooFewExamples(ValueError):
    """A pool, or a stratum of one, too small for the demonstration sets. The message names the
    options as keywords (``demos_per_set=8``, ``replacement=True``); :meth:`say` names them
    otherwise (a command: by its flags)."""

    def __init__(self, template: str, **values: Any) -> None:
        self.template, self.values = template, values
        super().__init__(self.say(lambda name, v: f"{name}={v}"))

    def say(self, option: Callable[[str, Any], str]) -> str:
        """The message with each option as ``option(name, value)`` gives it."""
        return self.template.format(**{k: option(k, v) for k, v in self.values.items()})


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
    stratify: str | Sequence | None = None,
    strata_order: str = "fixed",
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
        stratify: per-example strata, so that every set at every ratio holds the same number of
            examples of each stratum and only correctness changes with ``r`` (e.g. the label
            each demonstration's y states: a small model reads the label frequency of the
            demonstrations as much as their correctness). ``"y"``: each example's y is its
            stratum; ``"auto"``: ``"y"`` when the answers look like labels - at least 2 and at
            most ``N // 2`` distinct values, each with enough examples in both pools for the
            rule below - and no stratification otherwise (free-text answers); or a pair
            ``(good_strata, bad_strata)`` of str sequences as long as the pools; or one str
            sequence of ``len(good) + len(bad)`` (good first). None: no stratification (the
            sets are then exactly those of earlier versions).
        strata_order: with ``stratify``: ``"fixed"`` (default), every set lays its strata out
            in one seeded order (the same stratum at each position in every set, e.g. the label
            of the last demonstration, which small models tend to copy), and only which
            positions hold good examples is drawn per set; ``"shuffled"``, each set's positions
            are shuffled (equal counts only: on FPB and SST-2 with the embedded model the label
            of the last demonstration then decided the score, and correct-vs-incorrect AUC
            stayed at ~0.5, against 0.6-0.7 with the fixed order).

    Stratification rule: with ``K`` strata (the distinct names in both pools, sorted), every set
    holds ``c_s = N // K`` examples of each stratum, plus one more for each of the first
    ``N % K`` strata in sorted order (so take ``N`` a multiple of ``K`` for equal counts).
    A set's good demonstrations (``round(r * N)``, or a Bernoulli count) are split over the
    strata in proportion to ``c_s``: ``floor(n_good * c_s / N)`` each, the remaining ones to
    strata drawn at random (seeded) among those with room; the stratum's other slots take bad
    examples of that stratum. Positions are shuffled (or follow the fixed order, see
    ``strata_order``). Without replacement every stratum needs
    ``c_s`` examples in each pool (``r = 1`` takes them all from the good pool, ``r = 0`` from
    the bad one); with replacement at least one.

    Returns:
        ``sets[j][l]``: a :class:`DemoSet`, ``j`` in ``0..M``, ``l`` in ``0..L-1``.

    Raises:
        ValueError: bad sizes, unknown mixing, a pool too small for ``N`` without replacement,
            malformed strata, or a stratum with too few examples in a pool (naming it).
    """
    for name, v, lo in (("num_ratios", num_ratios, 2), ("demos_per_set", demos_per_set, 1),
                        ("sets_per_ratio", sets_per_ratio, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if mixing not in ("exact", "bernoulli"):
        raise ValueError(f"mixing must be 'exact' or 'bernoulli', got {mixing!r}")
    if strata_order not in ("shuffled", "fixed"):
        raise ValueError(f"strata_order must be 'shuffled' or 'fixed', got {strata_order!r}")
    g = check_pool(good, "good")
    b = check_pool(bad, "bad")
    n = demos_per_set
    # The pure ratios (r=1, r=0) need N of one pool whatever the mixing.
    if not g or not b or (not replacement and (len(g) < n or len(b) < n)):
        raise TooFewExamples(
            f"too few examples for {{demos_per_set}}: {len(g)} good and {len(b)} bad "
            f"(each pool needs at least {n if not replacement else 1}"
            + ("" if replacement else "; or pass {replacement}") + ")",
            demos_per_set=n, replacement=True)
    m = num_ratios - 1
    rng = random.Random(seed)
    if isinstance(stratify, str) and stratify == "auto":
        stratify = "y" if _labels_fit(g, b, n, replacement) else None
    if stratify is not None:
        gs, bs = _strata(stratify, g, b)
        return _stratified_sets(g, b, gs, bs, num_ratios=num_ratios, n=n,
                                sets_per_ratio=sets_per_ratio, rng=rng, mixing=mixing,
                                replacement=replacement, fixed_order=strata_order == "fixed")
    sets: list[list[DemoSet]] = []
    for j in range(num_ratios):
        r = j / m
        row = []
        for li in range(sets_per_ratio):
            if mixing == "exact":
                n_good = _exact_n_good(r, n)
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


def _exact_n_good(r: float, n: int) -> int:
    """Good demonstrations of a set of ``n`` at ratio ``r`` with ``mixing="exact"``: ``r * n``
    rounded half up (unlike Python's round()), for the plain and the stratified sets alike."""
    return int(math.floor(r * n + 0.5))


def _stratum_counts(names: list[str], n: int) -> dict[str, int]:
    """Examples of each stratum in every set: ``n // K``, one more for the first ``n % K``."""
    k = len(names)
    return {s: n // k + (1 if i < n % k else 0) for i, s in enumerate(names)}


def _labels_fit(g: list[Example], b: list[Example], n: int, replacement: bool) -> bool:
    """Whether ``stratify="auto"`` stratifies by y (see ``build_demo_sets``)."""
    names = sorted({y for _, y in g} | {y for _, y in b})
    if not 2 <= len(names) <= n // 2:
        return False
    for s, c in _stratum_counts(names, n).items():
        need = 1 if replacement else c
        if sum(y == s for _, y in g) < need or sum(y == s for _, y in b) < need:
            return False
    return True


def _strata(stratify: str | Sequence, g: list[Example], b: list[Example]
            ) -> tuple[list[str], list[str]]:
    """Per-example strata of the good and bad pools from ``build_demo_sets``' ``stratify``."""
    if isinstance(stratify, str):
        if stratify != "y":
            raise ValueError(f"stratify must be 'y', 'auto', a (good_strata, bad_strata) pair or a "
                             f"sequence of str, got the string {stratify!r}")
        return [y for _, y in g], [y for _, y in b]
    try:
        seq = list(stratify)
    except TypeError:
        raise TypeError(f"stratify must be 'y', 'auto', a (good_strata, bad_strata) pair or a "
                        f"sequence of str, got {type(stratify).__name__}") from None
    if len(seq) == 2 and all(isinstance(v, (list, tuple)) for v in seq):
        gs, bs = list(seq[0]), list(seq[1])
        for name, got, pool in (("good", gs, g), ("bad", bs, b)):
            if len(got) != len(pool):
                raise ValueError(f"stratify: {len(got)} {name} strata for {len(pool)} {name} "
                                 "examples")
        where = [f"stratify[0][{i}]" for i in range(len(gs))] + \
            [f"stratify[1][{i}]" for i in range(len(bs))]
    else:
        if len(seq) != len(g) + len(b):
            raise ValueError(f"stratify: {len(seq)} strata for {len(g)} good + {len(b)} bad "
                             f"examples (need {len(g) + len(b)}, good first)")
        gs, bs = seq[: len(g)], seq[len(g):]
        where = [f"stratify[{i}]" for i in range(len(seq))]
    for w, v in zip(where, gs + bs, strict=True):
        if not isinstance(v, str):
            raise TypeError(f"{w} must be a str, got {type(v).__name__}")
    return gs, bs


def _stratified_sets(g: list[Example], b: list[Example], gs: list[str], bs: list[str], *,
                     num_ratios: int, n: int, sets_per_ratio: int, rng: random.Random,
                     mixing: str, replacement: bool, fixed_order: bool = False
                     ) -> list[list[DemoSet]]:
    """``build_demo_sets`` with fixed per-stratum counts (the rule is in its docstring)."""
    names = sorted(set(gs) | set(bs))
    k = len(names)
    count = _stratum_counts(names, n)
    idx_g = {s: [i for i, v in enumerate(gs) if v == s] for s in names}
    idx_b = {s: [i for i, v in enumerate(bs) if v == s] for s in names}
    for s in names:
        need = min(count[s], 1) if replacement else count[s]
        if len(idx_g[s]) < need or len(idx_b[s]) < need:
            raise TooFewExamples(
                f"stratify: stratum {s!r} has {len(idx_g[s])} good and {len(idx_b[s])} bad "
                f"examples; every set holds {count[s]} of it (N={n} over {k} strata "
                f"{names!r}), so each pool needs at least {need}".replace("{", "{{")
                .replace("}", "}}")
                + ("" if replacement else " (or pass {replacement})"), replacement=True)
    m = num_ratios - 1
    order: list[str] = []
    if fixed_order:
        order = [s for s in names for _ in range(count[s])]
        rng.shuffle(order)
    sets: list[list[DemoSet]] = []
    for j in range(num_ratios):
        r = j / m
        row = []
        for li in range(sets_per_ratio):
            if mixing == "exact":
                n_good = _exact_n_good(r, n)
            else:
                n_good = sum(rng.random() < r for _ in range(n))
            good_of = {s: n_good * count[s] // n for s in names}
            for _ in range(n_good - sum(good_of.values())):
                room = [s for s in names if good_of[s] < count[s]]
                good_of[rng.choice(room)] += 1
            if fixed_order:
                # Which of each stratum's fixed positions hold its good examples.
                flags: list[bool] = [False] * n
                for s in names:
                    at = [i for i, v in enumerate(order) if v == s]
                    for i in rng.sample(at, good_of[s]):
                        flags[i] = True
                slots = list(zip(order, flags, strict=True))
            else:
                slots = [(s, True) for s in names for _ in range(good_of[s])] + \
                    [(s, False) for s in names for _ in range(count[s] - good_of[s])]
                rng.shuffle(slots)
            draws: dict[tuple[str, bool], list[int]] = {}
            for s in names:
                for flag, idx in ((True, idx_g[s]), (False, idx_b[s])):
                    c = good_of[s] if flag else count[s] - good_of[s]
                    draws[(s, flag)] = ([rng.choice(idx) for _ in range(c)] if replacement
                                        else rng.sample(idx, c))
            examples = tuple((g if f else b)[draws[(s, f)].pop()] for s, f in slots)
            row.append(DemoSet(ratio=r, examples=examples, is_good=tuple(f for _, f in slots),
                               ratio_index=j, set_index=li, strata=tuple(s for s, _ in slots)))
        sets.append(row)
    return sets
