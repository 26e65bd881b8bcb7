"""Glass-box self-evaluation features: how confident the evaluator model is about a response.

Every feature is computed from one padded forward of ``prompt + response`` per batch, where the
prompt is the instruction formatted with the tokenizer's chat template (or a plain
``### Instruction / ### Response`` template when there is none). Prompt and response are
tokenised as one string, exactly as a plain forward over the full text sees them, and split by
character offsets (:func:`encode`). In the standard mode the response token ``y_t`` at
position ``t`` is scored by the hidden state at position ``t - 1``; the LM-head statistics come
from :func:`icqs_fast.ops.linear_token_stats` on the gathered response hidden states (the
``[tokens, vocab]`` log-softmax is never built).

Features (per response; ``FEATURE_DIRECTION`` gives +1 where higher = better quality and -1
where lower = better, the reading of the SelfEval paper, in which entropy / variance /
disagreement are uncertainty and uncertainty means lower quality):

==================  ==========================================================================  ===
``sent_logprob``    mean over response tokens of ``log p(y_t | prefix)``                        +1
``softmax_ent``     mean over response tokens of the Shannon entropy ``-sum_v p_v log p_v``     -1
``softmax_var``     mean over response tokens of the (unbiased) variance of ``log p_v`` over    -1
                    the vocabulary (``TokenStats.logprob_var``; equals the variance of the
                    logits, since log-softmax only shifts them)
``token_prob_var``  variance (population, ddof=0; 0 for one token) over response tokens of      -1
                    ``p(y_t)``
``softmax_combo``   ``(norm(softmax_ent) + norm(softmax_var)) / 2`` with fixed constants        -1
                    (:class:`ComboScale`), so per item: by default ``softmax_ent / log V`` and
                    ``softmax_var / (log V)^2``; or min-max against a calibration set's ranges
                    (``ComboScale.fit``)
``attn_ent_avg``    attention entropy of each response query over the instruction keys (the     -1
                    instruction's own tokens, not the template or history), renormalised over
                    those keys, averaged over response tokens per layer x head, then averaged
                    over layer x head
``attn_ent_min``    the same, minimised over layer x head                                        -1
==================  ==========================================================================  ===

``mode="selfeval-compat"`` reproduces the formulas of the original SelfEval code
(``get_single_evaluation`` in ``llm_judge/gen_single_answer_selfeval.py`` of HuihuiChyan/SelfEval,
modes ``logprobs``, ``logprobs-entropy``, ``logprobs-variance``; a plain torch path over the full
logits, for comparison only). With ``p`` = prompt length and ``L`` = sequence length of a row,
``z_t`` = the logits at position ``t`` and ``ls_t = log_softmax(z_t)``, the original masks every
position ``t < p`` to 0 and keeps positions ``[p, L)`` - the usual window ``[p-1, L-1)`` shifted by
one: the first response token's own prediction (position ``p - 1``) is left out and the last
position, which predicts past the response, is included:

* ``sent_logprob`` = ``(sum_{t=p}^{L-2} ls_t[ids[t+1]] + ls_{L-1}[ids[0]]) / (L - p)``. The
  original gathers at the ids rolled left by one (``torch.roll(ids, -1)``), so position ``t``
  reads ``ids[t+1]`` and the last position wraps around to ``ids[0]`` (the first token of the
  prompt); the sum over ``L - p`` positions is divided by ``target_len = L - p``. It is therefore
  *not* the usual mean response log-probability: ``y_p`` is never scored and one term is the
  log-probability of the sequence's first token after the end of the response;
* ``softmax_ent`` = mean over positions ``[p, L)`` of ``mean_v(ls_t[v] * z_t[v])`` (no minus sign;
  it is *not* a Shannon entropy). The original divides the sum over the vocabulary by the constant
  32000 (Llama-2's vocabulary size); we divide by the model's vocabulary size ``V``, the same for a
  32000-token vocabulary and a constant factor ``V / 32000`` otherwise;
* ``softmax_var`` = mean over positions ``[p, L)`` of ``torch.var(ls_t)`` over the vocabulary
  (unbiased);
* ``token_prob_var`` has no counterpart in the original code (neither ``get_single_evaluation``
  nor the ensemble driver ``llm_judge/gen_model_answer_selfeval.py`` computes a variance of the
  token probabilities; the latter only averages the members' scores). The compat value is our
  definition: unbiased ``torch.var`` of ``p(y_t)`` over the *usual* window (``ls_{t-1}[ids[t]]``,
  ``t`` in ``[p, L)``; NaN for one token);
* ``softmax_combo`` and the attention features as in the standard mode (the combo's default
  ``ComboScale.intrinsic`` then scales the compat ``softmax_ent``, which is not an entropy, by
  ``log V`` all the same: a fixed per-item scale, not a range).

``softmax_combo`` is per item. SelfEval averages the entropy and the variance features after
min-max normalising each over the evaluated set, so that the two, in different units (nats,
nats^2), weigh alike. Normalising over "whatever is scored in the same call" made an answer's
value depend on its batch (and on sharding or streaming), so the constants are now fixed: by
default from the model alone (``[0, log V]`` is the entropy's exact range, and ``(log V)^2`` the
matching unit for a variance of log-probabilities), or fitted once on a calibration set with
``ComboScale.fit`` and passed as ``combo_scale`` (stored with ``ComboScale.as_dict``).
``ComboScale.fit`` on the evaluated set itself gives back SelfEval's dataset-level min-max.
Because the combo is affine in the two features, its rank correlations depend only on the ratio
of the two scales: the intrinsic default weighs them differently from a dataset min-max.

In a batch every row is right-padded and sliced back to its own ``L`` before these formulas are
applied, so the window, the wrap-around token ``ids[0]`` and ``L - p`` are the row's own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import ops
from icqs_fast.engine.batching import last_hidden, model_device
from icqs_fast.engine.capability import dense_head_weight, model_plan
from icqs_fast.engine.prompt_tokens import first_response_token, joins_response
from icqs_fast.engine.prompts import adds_bos
from icqs_fast.features.names import (  # noqa: F401 (re-exported)
    ALL_FEATURES,
    ATTN_FEATURES,
    FEATURE_DIRECTION,
    MODES,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_SENTINEL = "\u0000ICQS_INSTRUCTION\u0000"


@dataclass(frozen=True)
class GlassboxItem:
    """One response to score.

    Attributes:
        instruction: the (current-turn) user instruction.
        response: the scored assistant answer.
        reference: optional reference answer (used by the reference augmentations).
        history: earlier ``(user, assistant)`` turns placed before the instruction (e.g. MT-Bench
            turn 1 when scoring turn 2).
        system_prompt: per-item system prompt; overrides the call's ``system_prompt``.
    """

    instruction: str
    response: str
    reference: str | None = None
    history: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    system_prompt: str | None = None


def as_item(x: Any) -> GlassboxItem:
    """Normalise ``(instruction, response[, reference])`` tuples, dicts with those keys (plus
    optional ``history`` and ``system_prompt``) or :class:`GlassboxItem` objects."""
    if isinstance(x, GlassboxItem):
        return x
    if isinstance(x, Mapping):
        missing = [k for k in ("instruction", "response") if k not in x]
        if missing:
            raise ValueError(f"item {x!r:.80} lacks field(s) {missing}")
        hist = tuple((str(q), str(a)) for q, a in (x.get("history") or ()))
        return GlassboxItem(str(x["instruction"]), str(x["response"]), x.get("reference"), hist,
                            x.get("system_prompt"))
    if isinstance(x, (tuple, list)) and len(x) in (2, 3):
        return GlassboxItem(str(x[0]), str(x[1]), x[2] if len(x) == 3 else None)
    raise TypeError(f"an item must be (instruction, response[, reference]), a dict or a "
                    f"GlassboxItem, got {type(x).__name__}")


# --------------------------------------------------------------------------- tokenisation


@dataclass
class _Encoded:
    ids: list[int]
    prompt_len: int
    instr: tuple[int, int]  # key range of the instruction's own tokens
    join: bool = False  # the first response token begins inside the prompt text


def _has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer: PreTrainedTokenizerBase, item: GlassboxItem, system_prompt: str | None = None,
           use_chat_template: bool | None = None) -> _Encoded:
    """Token ids of ``prompt + response`` and where the instruction sits.

    The prompt text is built with a sentinel in place of the instruction, which then takes the
    sentinel's place; ``prompt + response`` is tokenised as one string (the chat template writes
    its own special tokens; with the plain template BOS comes first when the tokenizer adds one),
    so the ids are those a plain forward over the full text sees. The split comes from the
    tokens' character offsets (a fast tokenizer is needed): the response is every token from the
    first one that holds a response character (a token straddling the prompt/response seam is
    scored with the response, :func:`icqs_fast.engine.prompt_tokens.first_response_token`), and the
    instruction's
    key range is the tokens whose spans overlap the instruction's characters (a token it shares
    with the template text included).

    Returns:
        ``_Encoded``: ``ids`` (list of int), ``prompt_len`` (tokens before the response) and
        ``instr`` (``[start, end)`` token range of the instruction) and ``join`` (the first
        response token begins inside the prompt text: it merges the two).

    Raises:
        TypeError: a tokenizer without character offsets (not a fast tokenizer).
        ValueError: the template does not keep the instruction as one piece, or gives no prompt
            tokens.
    """
    sp = item.system_prompt if item.system_prompt is not None else system_prompt
    chat = _has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    if chat:
        msgs = [{"role": "system", "content": sp}] if sp else []
        for q, a in item.history:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": _SENTINEL})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        bos = []  # the template writes its own special tokens
    else:
        text = (sp + "\n\n") if sp else ""
        for q, a in item.history:
            text += f"### Instruction:\n{q}\n\n### Response:\n{a}\n\n"
        text += f"### Instruction:\n{_SENTINEL}\n\n### Response:\n"
        bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template did not keep the instruction as one piece of text")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: the glass-box "
                        "features need character offsets to split prompt and response")
    head, tail = text.split(_SENTINEL)
    ins_start, ins_end = len(head), len(head) + len(item.instruction)
    prompt_text = head + item.instruction + tail
    enc = tokenizer(prompt_text + item.response, add_special_tokens=False,
                    return_offsets_mapping=True)
    offs = [tuple(o) for o in enc["offset_mapping"]]
    ids = bos + list(enc["input_ids"])
    n_bos = len(bos)
    prompt_len = n_bos + first_response_token(offs, len(prompt_text))
    if prompt_len == 0:
        raise ValueError("empty prompt: the instruction and template produce no tokens")
    # Instruction tokens: spans overlapping [ins_start, ins_end) (none for an empty one).
    i0 = first_response_token(offs, ins_start)
    i1 = i0 if ins_end == ins_start else sum(1 for a, _ in offs if a < ins_end)
    return _Encoded(ids, prompt_len, (n_bos + i0, n_bos + max(i0, i1)),
                    joins_response(offs, len(prompt_text)))


# --------------------------------------------------------------------------- main entry


def _check_features(features: Iterable[str]) -> list[str]:
    feats = list(features)
    bad = [f for f in feats if f not in ALL_FEATURES]
    if bad:
        raise ValueError(f"unknown feature(s) {bad}; choose from {list(ALL_FEATURES)}")
    return feats


def vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(dense_head_weight(head).shape[0])  # a 4-bit head's weight is packed
    return int(model.config.vocab_size)


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pid = getattr(tokenizer, "pad_token_id", None)
    if pid is None:
        pid = getattr(tokenizer, "eos_token_id", None)
    return int(pid) if pid is not None else 0


def _batches(encs: list[_Encoded], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(encs)), key=lambda i: len(encs[i].ids))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _padded(encs: list[_Encoded], idx: list[int], pad_id: int, dev: torch.device):
    t = max(len(encs[i].ids) for i in idx)
    ids = torch.full((len(idx), t), pad_id, dtype=torch.long)
    am = torch.zeros((len(idx), t), dtype=torch.long)
    for r, i in enumerate(idx):
        n = len(encs[i].ids)
        ids[r, :n] = torch.tensor(encs[i].ids, dtype=torch.long)
        am[r, :n] = 1
    return ids.to(dev), am.to(dev)


def _attn_summaries(ent: torch.Tensor | None, encs: list[_Encoded], idx: list[int]
                    ) -> torch.Tensor | None:
    """``[B, 2]`` float64 on the device: per row, the attention entropy of its response
    queries averaged over them per layer x head, then the mean and the min over layer x head
    (NaN for a row without response tokens); None without a capture. No host sync: the
    batch's one device-to-host copy carries it."""
    if ent is None:
        return None
    t = ent.shape[-1]
    pos = torch.arange(t, device=ent.device)
    lo = torch.tensor([encs[i].prompt_len for i in idx], device=ent.device)
    hi = torch.tensor([len(encs[i].ids) for i in idx], device=ent.device)
    w = ((pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])).double()  # [B, T]
    cnt = w.sum(-1)
    per_head = (ent.double() * w[:, None, None]).sum(-1) / cnt.clamp_min(1)[:, None, None]
    out = torch.stack([per_head.mean((1, 2)), per_head.amin((1, 2))], dim=-1)
    return torch.where((cnt > 0)[:, None], out, torch.full_like(out, math.nan))


def _attn_summary(summ: torch.Tensor | None, r: int) -> dict[str, float]:
    """Row ``r`` of the host copy of :func:`_attn_summaries`."""
    if summ is None:
        return {"attn_ent_avg": math.nan, "attn_ent_min": math.nan}
    return {"attn_ent_avg": float(summ[r, 0]), "attn_ent_min": float(summ[r, 1])}


def _device_extras(cap, summ: torch.Tensor | None) -> list[torch.Tensor]:
    """What rides along in the batch's one copy besides the statistics: the attention
    summaries and the capture's mask check."""
    extra = []
    if summ is not None:
        extra.append(summ)
    if cap is not None and cap.mask_bad is not None:
        extra.append(cap.mask_bad.reshape(1))
    return extra


def _host_extras(cap, summ: torch.Tensor | None, host: list[torch.Tensor]
                 ) -> torch.Tensor | None:
    """Check the capture's mask flag and return the host attention summaries."""
    host = list(host)
    if cap is not None and cap.mask_bad is not None:
        cap.check_mask(bool(host.pop()[0]))
    return host[0] if summ is not None else None


def _capture_masks(encs: list[_Encoded], idx: list[int], shape: torch.Size,
                   dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention-entropy capture's inputs for a padded batch: ``query_mask [B, T]`` bool
    (the response tokens) and ``key_range [B, 2]`` (the instruction's token span)."""
    qm = torch.zeros(shape, dtype=torch.bool, device=dev)
    kr = torch.zeros((len(idx), 2), dtype=torch.long, device=dev)
    for r, i in enumerate(idx):
        qm[r, encs[i].prompt_len:len(encs[i].ids)] = True
        kr[r, 0], kr[r, 1] = encs[i].instr
    return qm, kr


def _standard_batch(model: PreTrainedModel, encs, idx, pad_id, want_attn,
                    backend) -> list[dict[str, float]]:
    dev = model_device(model)
    ids, am = _padded(encs, idx, pad_id, dev)
    # The capability check's decoder body and logit epilogue; a head it cannot reproduce is read
    # from the model's own logits instead (same statistics, a [tokens, vocab] tensor built).
    plan = model_plan(model)
    run = (lambda: model(input_ids=ids, attention_mask=am, use_cache=False).logits) \
        if plan.own_logits else \
        (lambda: last_hidden(plan.body(input_ids=ids, attention_mask=am, use_cache=False)))
    ent = cap = None
    if want_attn:
        from icqs_fast.features.attention import capture_attention_entropy

        qm, kr = _capture_masks(encs, idx, ids.shape, dev)
        # The mask check rides in the batch's one device-to-host copy (check_mask=False); a
        # backend without attention entropy leaves the capture to "auto" (support table).
        with capture_attention_entropy(model, qm, kr, backend=backend,
                                       check_mask=False) as cap:
            hidden = run()
        ent = cap.entropy
    else:
        hidden = run()
    rows, cols, spans = [], [], []
    start = 0
    for r, i in enumerate(idx):
        p, n = encs[i].prompt_len, len(encs[i].ids)
        rows += [r] * (n - p)
        cols += list(range(p - 1, n - 1))
        spans.append((start, start + n - p))
        start += n - p
    rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
    cols_t = torch.tensor(cols, dtype=torch.long, device=dev)
    h = hidden[rows_t, cols_t]
    targets = ids[rows_t, cols_t + 1]
    ts = ops.token_stats(h, targets, backend=backend) if plan.own_logits else \
        plan.head_stats(h, targets, backend)
    # One device-to-host copy per batch (statistics, attention summaries, mask check); the
    # per-response means are taken on the host, not one sync per feature and response.
    summ = _attn_summaries(ent, encs, idx)
    ts, host = ts.to_host_with(_device_extras(cap, summ),
                               ("logprob", "entropy", "logprob_var"))
    summ = _host_extras(cap, summ, host)
    res = []
    for r in range(len(idx)):
        s, e = spans[r]
        n = e - s
        d: dict[str, float] = {"n_tokens": n}
        if n == 0:
            d.update(sent_logprob=math.nan, softmax_ent=math.nan, softmax_var=math.nan,
                     token_prob_var=math.nan)
        else:
            lp = ts.logprob[s:e].double()
            d["sent_logprob"] = float(lp.mean())
            d["softmax_ent"] = float(ts.entropy[s:e].double().mean())
            d["softmax_var"] = float(ts.logprob_var[s:e].double().mean())
            d["token_prob_var"] = float(lp.exp().var(unbiased=False))
        d.update(_attn_summary(summ, r))
        res.append(d)
    return res


def _selfeval_tensors(logits: torch.Tensor, ids: torch.Tensor, prompt_len: int
                      ) -> torch.Tensor:
    """:func:`selfeval_formulas` on the device: ``[4]`` float64 (sent_logprob, softmax_ent,
    softmax_var, token_prob_var; the last NaN for one token), no host sync."""
    p, n = prompt_len, int(ids.shape[0])
    if not 1 <= p < n:
        raise ValueError(f"need 1 <= prompt_len < len(ids), got {p} and {n}")
    ls = torch.log_softmax(logits[p - 1:], dim=-1)  # rows: positions p-1 .. L-1
    # SelfEval's window: positions [p, L); position t reads ids[t+1], the last wraps to ids[0].
    nxt = torch.cat([ids[p + 1:], ids[:1]])
    lp_compat = ls[1:].gather(-1, nxt[:, None])[:, 0]
    # The usual window (positions [p-1, L-1) vs ids[p:]), for our token_prob_var only.
    lp_usual = ls[:-1].gather(-1, ids[p:, None])[:, 0]
    z, lz = logits[p:], ls[1:]
    # unbiased, as torch.var; NaN for one token (said here, without torch's warning)
    tpv = torch.var(lp_usual.exp()) if n - p > 1 else torch.full((), math.nan,
                                                                  device=logits.device)
    return torch.stack([(lp_compat.sum() / (n - p)).double(), (lz * z).mean(-1).mean().double(),
                        torch.var(lz, dim=-1).mean().double(), tpv.double()])


_SELFEVAL_KEYS = ("sent_logprob", "softmax_ent", "softmax_var", "token_prob_var")


def selfeval_formulas(logits: torch.Tensor, ids: torch.Tensor, prompt_len: int
                      ) -> dict[str, float]:
    """The SelfEval code's formulas for one unpadded row (``logits [L, V]``, ``ids [L]``,
    ``1 <= prompt_len < L``); see the module docstring. Plain torch in the logits' dtype
    (the float64 cast comes after each reduction)."""
    vals = _selfeval_tensors(logits, ids, prompt_len).tolist()
    return {"n_tokens": int(ids.shape[0]) - prompt_len, **dict(zip(_SELFEVAL_KEYS, vals,
                                                                   strict=True))}


def _compat_batch(model: PreTrainedModel, encs, idx, pad_id, want_attn,
                  backend) -> list[dict[str, float]]:
    dev = model_device(model)
    ids, am = _padded(encs, idx, pad_id, dev)
    ent = cap = None
    if want_attn:
        from icqs_fast.features.attention import capture_attention_entropy

        qm, kr = _capture_masks(encs, idx, ids.shape, dev)
        with capture_attention_entropy(model, qm, kr, backend=backend,
                                       check_mask=False) as cap:
            logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        ent = cap.entropy
    else:
        logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    # Every row's four values on the device, then one device-to-host copy per batch.
    nan4 = torch.full((4,), math.nan, dtype=torch.float64, device=dev)
    vals = [nan4 if len(encs[i].ids) == encs[i].prompt_len else
            _selfeval_tensors(logits[r, :len(encs[i].ids)].float(), ids[r, :len(encs[i].ids)],
                              encs[i].prompt_len) for r, i in enumerate(idx)]
    summ = _attn_summaries(ent, encs, idx)
    extra = [torch.stack(vals)] + _device_extras(cap, summ)
    host = torch.cat([t.double().reshape(-1) for t in extra]).cpu()
    parts, at = [], 0
    for t in extra:
        parts.append(host[at:at + t.numel()].reshape(t.shape))
        at += t.numel()
    vals_h = parts.pop(0)
    summ = _host_extras(cap, summ, parts)
    res = []
    for r, i in enumerate(idx):
        p, n = encs[i].prompt_len, len(encs[i].ids)
        d: dict[str, float] = {"n_tokens": n - p}
        d.update(zip(_SELFEVAL_KEYS, vals_h[r].tolist(), strict=True))
        d.update(_attn_summary(summ, r))
        res.append(d)
    return res


@dataclass(frozen=True)
class ComboScale:
    """Fixed normalisation constants of ``softmax_combo``: the ranges ``[ent_lo, ent_hi]`` of
    ``softmax_ent`` and ``[var_lo, var_hi]`` of ``softmax_var`` (floats). An item's combo is
    ``((ent - ent_lo) / (ent_hi - ent_lo) + (var - var_lo) / (var_hi - var_lo)) / 2``, not
    clipped (an item outside the calibration range gets a value outside [0, 1]; ranks are kept);
    a term with an empty range (``hi == lo``) is 0, as min-max gives for a constant feature.

    :meth:`fit` takes the constants from a calibration set's feature rows (SelfEval's min-max,
    with the set fixed once instead of "whatever shares the call"); :meth:`intrinsic` is the
    default, from the model alone (see the module docstring). Store :meth:`as_dict` with a run
    to score more items on the same scale later.
    """

    ent_lo: float
    ent_hi: float
    var_lo: float
    var_hi: float

    @classmethod
    def intrinsic(cls, vocab_size: int) -> ComboScale:
        """``softmax_ent / log V`` and ``softmax_var / (log V)^2``: the entropy's own range
        ``[0, log V]`` and the matching unit for a variance of log-probabilities."""
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        lv = math.log(vocab_size)
        return cls(0.0, lv, 0.0, lv * lv)

    @classmethod
    def fit(cls, rows: Iterable[Mapping[str, float]]) -> ComboScale:
        """Min and max of the finite ``softmax_ent`` / ``softmax_var`` values of ``rows`` (e.g.
        :func:`glassbox` rows of a calibration set)."""
        rows = list(rows)
        out = []
        for k in ("softmax_ent", "softmax_var"):
            ok = [float(r[k]) for r in rows if math.isfinite(r[k])]
            if not ok:
                raise ValueError(f"ComboScale.fit: no finite {k} in {len(rows)} row(s)")
            out += [min(ok), max(ok)]
        return cls(*out)

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> ComboScale:
        """Inverse of :meth:`as_dict`."""
        return cls(**{k: float(d[k]) for k in ("ent_lo", "ent_hi", "var_lo", "var_hi")})

    def as_dict(self) -> dict[str, float]:
        """The four constants, e.g. to store with a run's output."""
        return {"ent_lo": self.ent_lo, "ent_hi": self.ent_hi, "var_lo": self.var_lo,
                "var_hi": self.var_hi}

    def apply(self, ent: float, var: float) -> float:
        """The combo of one item (NaN when either input is NaN)."""
        if not (math.isfinite(ent) and math.isfinite(var)):
            return math.nan
        a = (ent - self.ent_lo) / (self.ent_hi - self.ent_lo) if self.ent_hi != self.ent_lo \
            else 0.0
        b = (var - self.var_lo) / (self.var_hi - self.var_lo) if self.var_hi != self.var_lo \
            else 0.0
        return (a + b) / 2


def add_softmax_combo(rows: list[dict[str, float]], scale: ComboScale) -> None:
    """Set ``softmax_combo`` in place from each row's own ``softmax_ent`` and ``softmax_var``
    and the fixed ``scale``: a row's value never depends on the other rows."""
    for r in rows:
        r["softmax_combo"] = scale.apply(r["softmax_ent"], r["softmax_var"])


@torch.no_grad()
def glassbox(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence[Any],
    *,
    features: Iterable[str] = ALL_FEATURES,
    mode: str = "standard",
    batch_size: int = 4,
    system_prompt: str | None = None,
    backend: str = "auto",
    use_chat_template: bool | None = None,
    reference: str | None = None,
    calibration_factor: float = 1.0,
    combo_scale: ComboScale | Mapping[str, float] | None = None,
    deterministic: bool = False,
) -> list[dict[str, float]]:
    """Glass-box features of each response (see the module docstring for definitions and the
    sign convention, ``FEATURE_DIRECTION``).

    Args:
        model, tokenizer: a Hugging Face causal LM (Llama/SmolLM2, GPT-2, ...) and its tokenizer.
        items: ``(instruction, response[, reference])`` tuples, dicts or :class:`GlassboxItem`.
        features: names from ``ALL_FEATURES``.
        mode: ``"standard"`` or ``"selfeval-compat"``.
        batch_size: items per padded forward (items are sorted by length first; results come
            back in input order and do not depend on the batching).
        system_prompt: system prompt for every item without its own.
        backend: token-statistics backend (``"auto"``, ``"cpp"``, ``"torch"``, ``"triton"``);
            the attention entropy uses the named backend where it has it (the support table
            of :mod:`icqs_fast.backends.support`), else auto.
        use_chat_template: None = use the tokenizer's chat template when it has one.
        reference: None; ``"illustrate"``: items with a reference get ``(instruction, reference)``
            prepended as a demonstration turn; ``"calibrate"``: every feature becomes
            ``feature(response) - calibration_factor * feature(reference as the response)``
            (items without a reference keep the plain feature).
        calibration_factor: the factor of ``"calibrate"``.
        combo_scale: the normalisation of ``softmax_combo`` (:class:`ComboScale` or its
            ``as_dict()``); None = :meth:`ComboScale.intrinsic` of the model's vocabulary.
            Either way an item's value depends on that item alone.
        deterministic: batch-invariant mode: every item runs in a forward (and an LM-head call)
            of its own, unpadded, whatever ``batch_size``, so its features are bit-identical
            whatever else is in ``items`` and their order. Slower (no batching).

    Returns:
        one dict per item, in order, with the requested features plus ``n_tokens`` (response
        tokens). Features of an empty response are NaN.

    Raises:
        TypeError: when the model has no output embeddings (LM head) at all.
    """
    feats = _check_features(features)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {list(MODES)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    its = [as_item(x) for x in items]
    if reference not in (None, "illustrate", "calibrate"):
        raise ValueError(f"reference must be None, 'illustrate' or 'calibrate', got {reference!r}")
    if reference == "illustrate":
        its = [illustrate(it) for it in its]
    elif reference == "calibrate":
        kw = dict(features=feats, mode=mode, batch_size=batch_size, system_prompt=system_prompt,
                  backend=backend, use_chat_template=use_chat_template, combo_scale=combo_scale,
                  deterministic=deterministic)
        return calibrate(model, tokenizer, its, factor=calibration_factor, **kw)
    if not its:
        return []
    if mode == "standard":  # the fused LM head replaces the model's logits: one check
        model_plan(model)
    encs = [encode(tokenizer, it, system_prompt, use_chat_template) for it in its]
    want_attn = any(f in ATTN_FEATURES for f in feats)
    fn = _standard_batch if mode == "standard" else _compat_batch
    pad_id = _pad_id(tokenizer)
    rows: list[dict[str, float] | None] = [None] * len(its)
    # A model whose states change under right padding (the capability check) runs items alone.
    alone = deterministic or (mode == "standard" and not model_plan(model).pad_safe)
    for idx in _batches(encs, 1 if alone else batch_size):
        for i, d in zip(idx, fn(model, encs, idx, pad_id, want_attn, backend), strict=True):
            rows[i] = d
    full = [r for r in rows if r is not None]
    if "softmax_combo" in feats:
        if combo_scale is None:
            combo_scale = ComboScale.intrinsic(vocab_size(model))
        elif not isinstance(combo_scale, ComboScale):
            combo_scale = ComboScale.from_dict(combo_scale)
        add_softmax_combo(full, combo_scale)
    return [{"n_tokens": r["n_tokens"], **{f: r[f] for f in feats}} for r in full]


# --------------------------------------------------------------------------- references


def illustrate(item: Any, template: str | None = None) -> GlassboxItem:
    """In-context illustration: the instruction with its reference answer, prepended as an
    earlier demonstration turn ``(instruction, reference)``; items without a reference are
    returned unchanged."""
    it = as_item(item)
    if not it.reference:
        return it
    return replace(it, history=((it.instruction, it.reference),) + tuple(it.history))


def calibrate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[Any], *,
              factor: float = 1.0,
              **kwargs: Any) -> list[dict[str, float]]:
    """Reference calibration: ``feature(response) - factor * feature(reference)``, where the
    reference answer is scored as if it were the response to the same prompt. Both sets are
    scored in one :func:`glassbox` call (``softmax_combo`` is per item, so it is calibrated like
    the other features). Items without a reference keep their uncalibrated features."""
    scored, has_ref = with_references(items)
    res = []
    for row, rr in pair_references(glassbox(model, tokenizer, scored, **kwargs), has_ref):
        row = dict(row)
        if rr is not None:
            for k, v in rr.items():
                if k != "n_tokens":
                    row[k] = row[k] - factor * v
        res.append(row)
    return res


def with_references(items: Sequence[Any]) -> tuple[list[GlassboxItem], list[bool]]:
    """The items, followed by the reference answer of each item that has one, as the response to
    the same prompt (what calibration scores), and which items have one."""
    its = [as_item(x) for x in items]
    has_ref = [bool(it.reference) for it in its]
    refs = [replace(it, response=it.reference) for it, h in zip(its, has_ref, strict=True) if h]
    return its + refs, has_ref


def pair_references(rows: Sequence[Any], has_ref: Sequence[bool]) -> list[tuple[Any, Any]]:
    """Rows scored on :func:`with_references`'s items, back per item: ``(row, reference row or
    None)``."""
    n = len(has_ref)
    ref_rows = iter(rows[n:])
    return [(row, next(ref_rows) if h else None)
            for row, h in zip(rows[:n], has_ref, strict=True)]
