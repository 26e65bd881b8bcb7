"""The request and response bodies of ``icqs-fast serve``, as pydantic models (the server's
``/openapi.json`` is generated from them).

Field names are OpenAI's (legacy ``/v1/completions``) where the route is OpenAI's. Every request
model forbids unknown fields and runs in strict mode (no ``"1"`` for ``1``, no ``true`` for
``1``), so a field we do not implement is a 400 naming it instead of being silently ignored.
Fields OpenAI defines that we accept only at their neutral value (``n``, ``suffix``, ...) are
typed here and refused by the route with a 400 naming them when set otherwise. Text fields
refuse strings that are not valid Unicode (a lone surrogate such as ``"\\ud800"``: JSON allows
the escape, UTF-8 and the tokenizer do not).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from icqs_fast.engine import settings
from icqs_fast.features.names import ALL_FEATURES
from icqs_fast.io import schema
from icqs_fast.options import declared


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at character {exc.start})"
                         ) from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]
FeatureName = Literal[tuple(ALL_FEATURES)]  # type: ignore[valid-type]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --------------------------------------------------------------------------- completions


class StreamOptions(_Request):
    """``stream_options`` of a streamed completion."""

    include_usage: bool | None = Field(None, description="true: a last chunk (no choices) "
                                       "carries the request's usage")


class CompletionRequest(_Request):
    """``POST /v1/completions`` (OpenAI legacy completions, greedy only)."""

    model: str | None = Field(None, description="the served model id (any other: 404)")
    prompt: (Text | Annotated[list[Text], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1)]) = Field(
        ..., description="a string, a list of strings, a list of token ids or a list of "
        "token-id lists")
    max_tokens: int | None = Field(16, ge=0, description="new tokens to generate greedily; 0 "
                                   "with echo=true scores the prompt")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, description="top-N alternatives per token")
    temperature: float | None = Field(None, ge=0, description="0 only when generating "
                                      "(sampling is not supported)")
    top_p: float | None = Field(None, gt=0, le=1, description="accepted: greedy decoding "
                                "keeps the argmax, which every nucleus holds")
    stop: Text | list[Text] | None = Field(None, description="generation ends at the first of "
                                           "these strings (at most --max-stop, each at most "
                                           "--max-stop-chars characters)")
    seed: int | None = Field(None, description="accepted: greedy decoding is deterministic")
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to the logits "
        "that choose generated tokens (their log-probs are of the biased distribution); prompt "
        "tokens are not chosen, so echoed log-probs are unbiased (at most --max-logit-bias "
        "entries)")
    n: int | None = Field(None, description="must be 1")
    best_of: int | None = Field(None, description="must be 1")
    stream: bool | None = Field(None, description="true: server-sent events, one "
                                "CompletionChunk per piece of text, then 'data: [DONE]'")
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    suffix: str | None = Field(None, description="must be null or empty")
    presence_penalty: float | None = Field(None, description="must be 0")
    frequency_penalty: float | None = Field(None, description="must be 0")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionStreamChoice(BaseModel):
    """One piece of a streamed choice: ``text`` continues the choice's text; the choice's last
    piece has its ``finish_reason``."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed ``/v1/completions`` (``data: {chunk}``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# --------------------------------------------------------------------------- score


class ScoreRecord(_Request):
    """One record: the query (``x``, or ``instruction`` / ``prompt``) and the response (``y``
    or ``response``); ``reference`` is read by the reference-based features."""

    x: Text | None = None
    instruction: Text | None = None
    prompt: Text | None = None
    y: Text | None = None
    response: Text | None = None
    reference: Text | None = None


class ScorePair(_Request):
    """One pair: the instruction (``x``, or ``instruction`` / ``prompt``) and its two outputs
    ``y_a`` and ``y_b`` (which is better: the response's ``pair.preferred``)."""

    x: Text | None = None
    instruction: Text | None = None
    prompt: Text | None = None
    y_a: Text
    y_b: Text


class Demonstration(_Request):
    x: Text
    y: Text


DemoPool = Annotated[list[Demonstration | Annotated[list[Text], Field(min_length=2,
                                                                       max_length=2)]],
                     Field(min_length=1)]


def icqs_options_model(settings_cls: Any = None) -> type[BaseModel]:
    """``/v1/score``'s ``icqs_options``, derived from the declarations of the
    :class:`~icqs_fast.engine.settings.ScoringSettings` options a request may set (declared
    ``request=True``): each field optional (null: the server's setting), typed by the
    declaration (choices as a ``Literal``), its default and bounds in the schema, and the bounds
    checked by the declaration itself, so an out-of-bounds value gets the message the command
    line gives ("--num-ratios must be an int >= 2, got 1"). ``settings_cls``: the settings
    class (default: ScoringSettings)."""
    cls = settings_cls or settings.ScoringSettings
    base: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": Text}
    fields: dict[str, Any] = {}
    for d in declared(cls):
        if not d.option.request:
            continue
        opt = d.option
        typ: Any = (Literal[opt.choices] if opt.choices is not None  # type: ignore[valid-type]
                    else base[opt.kind])
        schema = {k: v for k, v in (("minimum", opt.ge), ("exclusiveMinimum", opt.gt),
                                    ("maximum", opt.le)) if v is not None}
        fields[d.name] = (Annotated[typ | None, AfterValidator(_declared_check(d))],
                          Field(None, description=f"{opt.help} (null: the server's "
                                f"setting, {d.flag} at its start)",
                                json_schema_extra=schema or None))
    return create_model("IcqsOptions", __base__=_Request, **fields)


def _declared_check(d: Any) -> Any:
    """The declaration's own check of one option (its message names the flag)."""
    def check(v: Any) -> Any:
        return v if v is None else d.check(v)
    return check


IcqsOptions = icqs_options_model()


class ScoreRequest(_Request):
    """``POST /v1/score``: ICQS scores and/or glass-box features of ``records``."""

    model: str | None = None
    records: Annotated[list[ScoreRecord], Field(min_length=1)] | None = Field(
        None, description="the responses to score (or 'pairs')")
    pairs: Annotated[list[ScorePair], Field(min_length=1)] | None = Field(
        None, description="pairs to judge instead of records (as `score --pairs`): both "
        "outputs of each scored with ICQS, each item's 'pair' the per-pair fields")
    tie_margin: float | None = Field(None, ge=0, description="with 'pairs': scores this close "
                                     "or closer are a tie (`--tie-margin`; default 0)")
    features: bool | list[FeatureName] | None = Field(
        None, description="true: every feature; or a list of feature names")
    icqs: bool | None = Field(None, description="default: true when demonstrations are known")
    good: DemoPool | None = None
    bad: DemoPool | None = None
    icqs_options: IcqsOptions | None = None


def icqs_score_model(kind: str = "icqs") -> type[BaseModel]:
    """The ICQS part of a ``/v1/score`` item (``kind="pairs"``: a pair's), derived from the
    declared result schema (:data:`icqs_fast.io.schema.ICQS_FIELDS` /
    :data:`~icqs_fast.io.schema.PAIR_FIELDS`, the result's own fields): the same names, shapes
    and meanings as a ``score`` (``score --pairs``) output line; floats nullable (a
    non-finite number is null in JSON), fields present only sometimes optional."""
    base = {"int": int, "float": float | None, "bool": bool, "text": str}
    fields: dict[str, Any] = {}
    for f in schema.ICQS_FIELDS if kind == "icqs" else schema.PAIR_FIELDS:
        if f.source != "result":
            continue
        typ: Any = base[f.type]
        for _ in f.shape:
            typ = list[typ]
        fields[f.name] = ((typ, Field(description=f.meaning)) if not f.when else
                          (typ | None, Field(None, description=f"{f.meaning} ({f.when})")))
    return create_model("IcqsScore" if kind == "icqs" else "PairScore", **fields)


IcqsScore = icqs_score_model()
PairScore = icqs_score_model("pairs")


class ScoreItem(BaseModel):
    index: int
    icqs: IcqsScore | None = None
    pair: PairScore | None = None  # with 'pairs': the pair's judgement
    # int | float: the token count (n_tokens) stays an integer in the JSON.
    features: dict[str, int | float | None] | None = None


class ScoreResponse(BaseModel):
    object: Literal["list"]
    model: str
    data: list[ScoreItem]
    # The server's self-check (engine.selfcheck.SelfCheck.summary_dict: ICQS's AUC beside the
    # baselines', the warnings) when the records were scored with its own pools and settings,
    # whose map gave them p_good_calibrated; null otherwise.
    self_check: dict[str, Any] | None = None


# --------------------------------------------------------------------------- the rest


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    pending: int
    max_queue: int
    batches: int
    batched_prompts: int
    largest_batch: int
    rejected: int
    chunks: int
    timed_out: int
    cancelled: int
    interrupted: int = Field(0, description="running chunks stopped part-way because their "
                             "request had ended (deadline, disconnect, shutdown)")
    live_generations: int = Field(0, description="generations holding a KV cache now")
    steps: int = Field(0, description="worker steps run (each: one token of every live "
                       "generation and one slice of other work)")
    decode_tokens: int = Field(0, description="tokens of started generations, run beside "
                               "the slices")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


__all__ = ["CompletionChoice", "CompletionChunk", "CompletionLogprobs", "CompletionRequest",
           "CompletionResponse", "CompletionStreamChoice",
           "Demonstration", "ErrorDetail", "ErrorResponse", "Health", "IcqsOptions",
           "IcqsScore", "ModelCard", "ModelList", "PairScore", "ScoreItem", "ScorePair",
           "ScoreRecord", "ScoreRequest",
           "ScoreResponse", "StreamOptions", "Text", "Usage"]
