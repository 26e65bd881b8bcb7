"""The ICQS study's two baselines, on the same prefix-sharing engine: Ask LLM and ICL label.

* :func:`ask_llm` - "Ask LLM": the model is asked, with the single-answer grading prompt of
  Zheng et al. (2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", prompt
  ``single-v1``) adapted to a 1-5 scale, to rate a response ``y`` to an instruction ``x``. Nothing
  is generated: the prompt ends with the fixed answer prefix ``"Rating: [["`` and the rating is
  read from the next-token probabilities of the tokens ``"1"`` .. ``"5"`` (renormalised over the
  five: the argmax rating and the expected rating).
* :func:`icl_label` - plain in-context learning: a fixed set of demonstrations from the *good*
  pool (laid out with the ICQS engine's :class:`~icqs_fast.engine.prompts.Template`, so they look
  exactly as in ICQS), then the item ``x``; the predicted label is the candidate label with the
  largest ``log P(label | demos, x)``. A response ``y`` is judged correct when it is that label
  (:func:`is_correct`).

Both send every (prompt, option) pair to :func:`icqs_fast.engine.continuations.score_continuations`,
which computes the prompts' shared leading tokens (the judge instructions; the demonstrations)
once in its prefix bank, and applies the LM head only at the option tokens.

Usage (Python)::

    from icqs_fast.models import load_model
    from icqs_fast.evals.baselines import ask_llm, icl_label, is_correct

    model, tok = load_model()  # the embedded SmolLM2-135M-Instruct
    r = ask_llm(model, tok, [("What is 2 + 2?", "4"), ("What is 2 + 2?", "5")])
    r[0].rating_expected, r[0].rating_argmax, r[0].probs, r[0].mass

    demos = [("Profit rose by 20 %.", "positive"), ("Sales fell sharply.", "negative")]
    res = icl_label(model, tok, demos, ["Operating loss widened."], ["positive", "negative"])
    res[0].label, res[0].probs, is_correct(res[0], "negative")

From the command line they run inside ``icqs-fast eval fpb|sst2|chaosnli`` (beside ICQS and
ICQS-Epistemic), and on their own, one JSON line per record::

    python -m icqs_fast.evals.baselines ask-llm answers.jsonl            # fields x, y
    python -m icqs_fast.evals.baselines icl sentences.jsonl --demos good.jsonl \
        --labels positive,negative,neutral -o labels.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from icqs_fast.engine.checks import model_max_length, parse_response
from icqs_fast.engine.prompt_tokens import PromptTokens
from icqs_fast.engine.prompts import DemoSet, Example, Template, adds_bos, check_pool, fill_template
from icqs_fast.io.readers import RecordFields, read_examples, read_records

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Same default as the ICQS engine (icqs_fast.engine.scorer.DEFAULT_TOKEN_BUDGET), repeated here so
# that
# importing this module does not import the engine.
DEFAULT_TOKEN_BUDGET = 16384
RATINGS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class AskLLMTemplate:
    """The judge prompt of :func:`ask_llm`.

    Attributes:
        user: the judge instruction with ``{x}`` (the question) and ``{y}`` (the answer).
        system: system message; ``None`` keeps the chat template's default one (plain-text
            prompts then have none).
        answer_prefix: text after the prompt (after the assistant header with a chat template);
            the rating token is read right after it.
    """

    user: str
    system: str | None = "You are a helpful assistant."
    answer_prefix: str = "Rating: [["

    def __post_init__(self) -> None:
        for name in ("user", "answer_prefix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"AskLLMTemplate.{name} must be a str")
        if self.system is not None and not isinstance(self.system, str):
            raise TypeError("AskLLMTemplate.system must be a str or None")
        for f in ("{x}", "{y}"):
            if f not in self.user:
                raise ValueError(f"AskLLMTemplate.user must contain {f!r}")


# Zheng et al.'s single-answer grading prompt (FastChat judge_prompts.jsonl, "single-v1"), with
# the scale changed from 1-10 to 1-5 (as in the ICQS study) and the request for an explanation
# before the rating dropped: the rating is read as the very next token after "Rating: [[", so
# the prompt asks for it directly.
ASK_LLM_TEMPLATE = AskLLMTemplate(
    user=(
        "[Instruction]\n"
        "Please act as an impartial judge and evaluate the quality of the response provided by "
        "an AI assistant to the user question displayed below. Your evaluation should consider "
        "factors such as the helpfulness, relevance, accuracy, depth, creativity, and level of "
        "detail of the response. Be as objective as possible. You must rate the response on a "
        "scale of 1 to 5 by strictly following this format: \"[[rating]]\", for example: "
        "\"Rating: [[3]]\".\n\n"
        "[Question]\n{x}\n\n"
        "[The Start of Assistant's Answer]\n{y}\n[The End of Assistant's Answer]"
    ),
)


@dataclass
class AskLLMResult:
    """The judge's rating of one (x, y) item.

    Attributes:
        probs: 5 floats, P(rating = 1..5) renormalised over the five rating tokens (sum 1).
        rating_argmax: the most probable rating, 1..5 (the lowest on a tie).
        rating_expected: ``sum_k k * probs[k-1]``, in [1, 5].
        mass: the five tokens' total next-token probability before renormalising (how much the
            model's answer is a rating at all).
        logprobs: 5 floats, the unnormalised next-token log-probabilities of "1".."5".
        index: the item's position in the input.
    """

    probs: list[float]
    rating_argmax: int
    rating_expected: float
    mass: float
    logprobs: list[float] = field(default_factory=list)
    index: int = 0


@dataclass
class ICLResult:
    """The in-context label prediction for one item.

    Attributes:
        label: the predicted label (argmax of the scores; the first label on a tie).
        logliks: label -> ``log P(label | demos, x)``, summed over the label's response tokens
            (float64 sum).
        probs: label -> softmax of the scores over the candidate labels (sum 1); the scores are
            the logliks, or the logliks per token with ``length_normalize``.
        n_tokens: label -> number of scored tokens of the label's response text (after this
            item's prompt: whole-text tokenisation may merge a seam token into it).
        index: the item's position in the input.
    """

    label: str
    logliks: dict[str, float]
    probs: dict[str, float]
    n_tokens: dict[str, int]
    index: int = 0


def is_correct(result: ICLResult, y: str) -> bool:
    """A response ``y`` is judged correct by the ICL baseline when it is the predicted label
    (surrounding whitespace ignored, case kept)."""
    if not isinstance(y, str):
        raise TypeError(f"y must be a str, got {type(y).__name__}")
    return y.strip() == result.label.strip()


# --------------------------------------------------------------------------- helpers


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return [int(tokenizer.bos_token_id)] if adds_bos(tokenizer) else []


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad) if pad is not None else 0


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return -math.inf
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _check_length(model: PreTrainedModel, n: int, what: str) -> None:
    lim = model_max_length(model, None)
    if lim is not None and n > lim:
        raise ValueError(f"{what}: prompt of {n} tokens exceeds the model's max length {lim}")


def _score(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
           requests: list[tuple[list[int], list[int]]], *,
           backend: str, token_budget: int, max_bank_tokens: int | None) -> list:
    from icqs_fast.engine.continuations import score_continuations

    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
        raise ValueError(f"token_budget must be an int >= 1, got {token_budget!r}")
    return score_continuations(model, requests, pad_id=_pad_id(tokenizer), backend=backend,
                               token_budget=token_budget, max_bank_tokens=max_bank_tokens)


def _parse_x(i: int, item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if "x" not in item:
            raise ValueError(f"item {i}: missing field 'x'")
        x = item["x"]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        x = item[0]
    else:
        raise TypeError(f"item {i}: expected a str x, an (x, y) pair or a dict with 'x', got "
                        f"{type(item).__name__}")
    if not isinstance(x, str):
        raise TypeError(f"item {i}: field 'x' must be a str, got {type(x).__name__}")
    return x


# --------------------------------------------------------------------------- Ask LLM


def ask_llm_prompt(tokenizer: PreTrainedTokenizerBase, x: str, y: str, *,
                   template: AskLLMTemplate = ASK_LLM_TEMPLATE,
                   chat: bool | None = None) -> str:
    """The judge prompt text for (x, y), ending with ``template.answer_prefix``.

    Args:
        chat: lay it out with the tokenizer's chat template (system + user turn + assistant
            header); None = when the tokenizer has one. Without it: system, a blank line, the
            user text, a blank line, the answer prefix.
    """
    user = fill_template(template.user, x=x, y=y)
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        msgs = [] if template.system is None else [{"role": "system", "content": template.system}]
        msgs.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text + template.answer_prefix
    head = f"{template.system}\n\n" if template.system else ""
    return f"{head}{user}\n\n{template.answer_prefix}"


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a whole prompt text, with BOS when the tokenizer adds one and the text (a
    rendered chat template) does not already start with it."""
    bos_tok = getattr(tokenizer, "bos_token", None)
    bos = [] if bos_tok and text.startswith(bos_tok) else _bos(tokenizer)
    return bos + _encode(tokenizer, text)


def rating_token_ids(tokenizer: PreTrainedTokenizerBase,
                     answer_prefix: str = ASK_LLM_TEMPLATE.answer_prefix
                     ) -> list[int]:
    """The ids of the tokens "1".."5" as they follow ``answer_prefix``.

    Raises:
        ValueError: a rating is not one token after the prefix (nor on its own), or two
            ratings share an id.
    """
    base = _encode(tokenizer, answer_prefix)
    ids = []
    for k in RATINGS:
        full = _encode(tokenizer, answer_prefix + str(k))
        if full[: len(base)] == base and len(full) == len(base) + 1:
            ids.append(full[-1])
            continue
        alone = _encode(tokenizer, str(k))  # the prefix's last token merges with the digit
        if len(alone) != 1:
            raise ValueError(f"rating {k!r} is {len(alone)} tokens for {type(tokenizer).__name__}"
                             f" after {answer_prefix!r}; Ask LLM needs one token per rating")
        ids.append(alone[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"the ratings 1..5 share token ids {ids}")
    return ids


def ask_llm(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence,
    *,
    template: AskLLMTemplate = ASK_LLM_TEMPLATE,
    chat: bool | None = None,
    backend: str = "auto",
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_bank_tokens: int | None = None,
) -> list[AskLLMResult]:
    """Ask LLM: the model's 1-5 rating of each (instruction x, response y), read from the
    next-token probabilities of "1".."5" after the judge prompt (:func:`ask_llm_prompt`).

    The prompt text is tokenised whole (BOS first when the tokenizer adds one); every item's
    prompt is scored with the five one-token continuations, so the judge instructions the
    prompts share (and each prompt itself, for its five options) run once in the prefix bank.

    Args:
        model, tokenizer: a causal LM (as for the ICQS engine) and its tokenizer.
        items: (x, y) str pairs or dicts with "x" and "y".
        template: the judge prompt (default :data:`ASK_LLM_TEMPLATE`).
        chat: use the tokenizer's chat template; None = when it has one.
        backend, token_budget, max_bank_tokens: passed to
            :func:`icqs_fast.engine.continuations.score_continuations`.

    Returns:
        one :class:`AskLLMResult` per item, in input order.

    Raises:
        TypeError / ValueError: a malformed item (naming its index), a prompt longer than the
            model's max length, or ratings that are not single tokens.
    """
    pairs = [parse_response(i, it, noun="item", allow_empty=True)
             for i, it in enumerate(items)]
    if not pairs:
        return []
    opt = rating_token_ids(tokenizer, template.answer_prefix)
    requests = []
    for i, (x, y) in enumerate(pairs):
        ctx = _prompt_ids(tokenizer, ask_llm_prompt(tokenizer, x, y, template=template,
                                                    chat=chat))
        _check_length(model, len(ctx) + 1, f"item {i}")
        requests.extend((ctx, [t]) for t in opt)
    res = _score(model, tokenizer, requests, backend=backend, token_budget=token_budget,
                 max_bank_tokens=max_bank_tokens)
    out = []
    k = len(opt)
    for i in range(len(pairs)):
        lp = [float(r.loglik) for r in res[i * k:(i + 1) * k]]
        lse = _logsumexp(lp)
        if lse == -math.inf:  # no rating token has any probability (masked logits)
            probs = [math.nan] * k
            argmax, expected = 0, math.nan
        else:
            probs = [math.exp(v - lse) for v in lp]
            argmax = RATINGS[max(range(k), key=lambda j: (probs[j], -j))]
            expected = sum(r * p for r, p in zip(RATINGS, probs, strict=True))
        out.append(AskLLMResult(probs=probs, rating_argmax=argmax, rating_expected=expected,
                                mass=math.exp(lse), logprobs=lp, index=i))
    return out


# --------------------------------------------------------------------------- ICL label


def icl_request_ids(tokenizer: PreTrainedTokenizerBase, demos: Sequence[Example], x: str,
                    label: str,
                    template: Template, *, max_length: int | None = None,
                    _tokens: Any = None) -> tuple[list[int], list[int]]:
    """``(context_ids, continuation_ids)`` of one (item, label) pair, tokenised exactly as the
    ICQS engine tokenises a response (:class:`icqs_fast.engine.prompt_tokens.PromptTokens`, whole
    text):
    BOS (when the tokenizer adds one) + ``prefix(demos) + query(x) + response(label)`` as one
    string, split where the response text starts (a token straddling that seam goes with the
    label); the response is ``template.format_response(label)`` (e.g. ``" positive\\n"``, so
    the label's end is scored too).

    Raises:
        ValueError: the prompt is longer than ``max_length`` (:class:`icqs_fast.engine.scorer.
            PromptTooLong`), or has fewer than two tokens before the label.
    """
    tokens = _tokens if _tokens is not None else _icl_tokens(tokenizer, demos, template)
    lay = tokens.layouts(0, x, label, max_length, False)[0]
    return lay.ids[:lay.n_prompt], lay.ids[lay.n_prompt:]


def _icl_tokens(tokenizer: PreTrainedTokenizerBase, demos: Sequence[Example],
                template: Template) -> Any:
    ds = DemoSet(ratio=1.0, examples=tuple(demos), is_good=(True,) * len(demos))
    return PromptTokens(tokenizer, template, [[ds]])


def icl_label(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demos: Sequence,
    items: Sequence,
    labels: Sequence[str],
    *,
    template: Template | None = None,
    length_normalize: bool = False,
    backend: str = "auto",
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_bank_tokens: int | None = None,
) -> list[ICLResult]:
    """ICL baseline: predict each item's label from a fixed set of good demonstrations.

    The prompt is the ICQS prompt with ``demos`` as the one demonstration set (the same for
    every item, so it is one shared prefix): ``system + demo(x_1, y_1) + separator + ... +
    query(x)``, and each candidate label ``c`` is scored as the response ``c``:
    ``log P(response(c) | prompt)``, the sum over its tokens. Multi-token labels are summed
    (a longer label pays for each token); ``length_normalize=True`` compares the mean per token
    instead.

    The prompt is tokenised as the ICQS engine tokenises its prompts (:func:`icl_request_ids`:
    the whole text, split where the label starts), so it is token for token the ICQS prompt of
    a set holding ``demos``: ICL and ICQS differ only in how they use the scores.

    Args:
        model, tokenizer: a causal LM and its tokenizer.
        demos: (x, y) str pairs (or dicts with "x"/"y") from the good pool, in prompt order;
            may be empty (zero-shot).
        items: the items' x: str, or (x, y) pairs / dicts whose "x" is used.
        labels: at least two distinct non-empty candidate label strings.
        template: prompt formats; the ICQS engine's default :class:`Template` if None.
        length_normalize: choose by log-likelihood per token instead of the sum.
        backend, token_budget, max_bank_tokens: passed to
            :func:`icqs_fast.engine.continuations.score_continuations`.

    Returns:
        one :class:`ICLResult` per item, in input order.

    Raises:
        TypeError / ValueError: malformed demos/items/labels (naming the index), a label with
            no tokens, or a prompt longer than the model's max length.
    """
    tpl = template if template is not None else Template()
    if not isinstance(tpl, Template):
        raise TypeError("template must be an icqs_fast.engine.prompts.Template, got "
                        f"{type(tpl).__name__}")
    d = check_pool(demos, "demos")
    if isinstance(labels, str):
        raise TypeError("labels must be a sequence of str, not one str")
    labs = list(labels)
    for j, lab in enumerate(labs):
        if not isinstance(lab, str) or not lab.strip():
            raise ValueError(f"labels[{j}] must be a non-empty str, got {lab!r}")
    if len(labs) < 2 or len(set(labs)) != len(labs):
        raise ValueError(f"labels must be at least two distinct strings, got {labs!r}")
    xs = [_parse_x(i, it) for i, it in enumerate(items)]
    if not xs:
        return []

    max_len = model_max_length(model, None)
    tokens = _icl_tokens(tokenizer, d, tpl)
    requests = []
    for i, x in enumerate(xs):
        for lab in labs:
            try:
                ctx, cont = icl_request_ids(tokenizer, d, x, lab, tpl, max_length=max_len,
                                            _tokens=tokens)
            except ValueError as exc:  # "response 0: ..." from the engine's tokenizer
                raise ValueError(f"item {i}, label {lab!r}: "
                                 f"{str(exc).removeprefix('response 0: ')}") from None
            requests.append((ctx, cont))
    res = _score(model, tokenizer, requests, backend=backend, token_budget=token_budget,
                 max_bank_tokens=max_bank_tokens)
    out = []
    k = len(labs)
    for i in range(len(xs)):
        rs = res[i * k:(i + 1) * k]
        ll = [float(r.loglik) for r in rs]
        nt = [r.n_tokens for r in rs]
        sc = [v / n for v, n in zip(ll, nt, strict=True)] if length_normalize else ll
        lse = _logsumexp(sc)
        probs = [math.exp(s - lse) if lse > -math.inf else math.nan for s in sc]
        best = max(range(k), key=lambda j: (sc[j], -j))
        out.append(ICLResult(label=labs[best], logliks=dict(zip(labs, ll, strict=True)),
                             probs=dict(zip(labs, probs, strict=True)),
                             n_tokens=dict(zip(labs, nt, strict=True)), index=i))
    return out


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m icqs_fast.evals.baselines ask-llm|icl ...``: one JSON line per input record on
    standard output (or ``-o FILE``); exit code 2 with a message on bad input."""
    from icqs_fast.models import load_model

    p = argparse.ArgumentParser(prog="python -m icqs_fast.evals.baselines",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="baseline", required=True)
    a = sub.add_parser("ask-llm", help="1-5 judge rating of each (x, y) record")
    c = sub.add_parser("icl", help="in-context label of each record's x")
    c.add_argument("--demos", required=True, help="good demonstrations (x/y fields)")
    c.add_argument("--labels", required=True, help="candidate labels, comma-separated")
    c.add_argument("--length-normalize", action="store_true",
                   help="choose by log-likelihood per token")
    for q in (a, c):
        q.add_argument("input", help="records (JSONL/CSV/TSV/Parquet; icl needs only x)")
        q.add_argument("-o", "--output", default="-", help="JSONL output (default: stdout)")
        q.add_argument("--x-field", default="x")
        q.add_argument("--y-field", default="y")
        q.add_argument("--model", default=None, help="model folder (default: the embedded one)")
        q.add_argument("--dtype", default="auto")
        q.add_argument("--backend", default="auto")
    args = p.parse_args(argv)
    try:
        # icl reads only x: x stands in as the record's y, which read_records requires.
        recs = list(read_records(args.input, RecordFields(
            args.x_field, args.y_field if args.baseline == "ask-llm" else args.x_field)))
        model, tok = load_model(args.model, dtype=args.dtype)
        if args.baseline == "ask-llm":
            rows = [{"index": r.index, "rating_expected": r.rating_expected,
                     "rating_argmax": r.rating_argmax, "probs": r.probs, "mass": r.mass}
                    for r in ask_llm(model, tok, [(r.x, r.y) for r in recs],
                                     backend=args.backend)]
        else:
            demos = read_examples(args.demos, x_field=args.x_field, y_field=args.y_field)
            labels = [s.strip() for s in args.labels.split(",") if s.strip()]
            rows = [{"index": r.index, "label": r.label, "probs": r.probs,
                     "logliks": r.logliks}
                    for r in icl_label(model, tok, demos, [r.x for r in recs], labels,
                                       length_normalize=args.length_normalize,
                                       backend=args.backend)]
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"python -m icqs_fast.evals.baselines: error: {exc}", file=sys.stderr)
        return 2
    for rec, row in zip(recs, rows, strict=True):
        if rec.id is not None:
            row["id"] = rec.id
    f = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    finally:
        if f is not sys.stdout:
            f.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
