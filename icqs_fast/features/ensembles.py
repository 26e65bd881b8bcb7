"""Ensemble uncertainty features: the spread of the evaluator's sentence probability over
members of an ensemble.

For each member ``m`` the sentence probability is ``P_m = exp(sent_logprob_m)``, the geometric
mean of the response's token probabilities (length-normalised, so long answers are not pushed to
0). Per item:

* ``unt_exp`` = mean over members of ``P_m`` (higher = more confident = better, direction +1);
* ``unt_var`` = population variance (ddof=0) over members of ``P_m`` (lower = better, -1).

Two ensembles:

* **prompt ensemble** (:func:`prompt_ensemble`): the same response scored under each system prompt
  of a pool (default: the 7 prompts of ``icqs_fast/data/system_prompts.json``). The members of an
  item share the response, so they go through one padded forward together (``batch_size`` items,
  i.e. ``batch_size x len(pool)`` rows, per forward; default one item); an item's members are
  never split over forwards.
* **decoding ensemble** (:func:`decoding_ensemble`): ``k`` responses sampled from the evaluator
  for the instruction with ``model.generate`` under fixed seeds (``seed + j`` for member ``j``),
  each scored by the evaluator. It measures the model's uncertainty about the *instruction* and
  does not look at the given response.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast.engine.batching import model_device
from icqs_fast.features.extract import (
    as_item,
    encode,
    glassbox,
    illustrate,
    pair_references,
    with_references,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def default_system_prompts() -> list[str]:
    """The 7 built-in system prompts."""
    text = resources.files("icqs_fast.data").joinpath("system_prompts.json").read_text("utf-8")
    return list(json.loads(text))


def _summary(logprobs: list[float]) -> dict[str, Any]:
    probs = [math.exp(v) if math.isfinite(v) else math.nan for v in logprobs]
    ok = [p for p in probs if math.isfinite(p)]
    if not ok:
        return {"unt_exp": math.nan, "unt_var": math.nan, "members": probs}
    mean = sum(ok) / len(ok)
    var = sum((p - mean) ** 2 for p in ok) / len(ok)
    return {"unt_exp": mean, "unt_var": var, "members": probs}


def prompt_ensemble(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    items: Sequence[Any], *,
                    system_prompts: Sequence[str] | None = None, batch_size: int = 1,
                    reference: str | None = None, calibration_factor: float = 1.0,
                    **kwargs: Any) -> list[dict[str, Any]]:
    """``unt_exp`` / ``unt_var`` over a pool of system prompts (see the module docstring).

    Args:
        items: as for :func:`icqs_fast.features.glassbox` (a per-item system prompt is replaced
            by each pool member).
        system_prompts: the pool; the 7 built-in prompts if None.
        batch_size: items per forward; each contributes all ``len(pool)`` members to it, so one
            forward holds ``batch_size * len(pool)`` rows (items in input order, not re-sorted).
        reference: None; ``"illustrate"``: items with a reference get it as a demonstration turn
            (:func:`icqs_fast.features.illustrate`) before being expanded over the pool;
            ``"calibrate"``: ``unt_exp`` and ``unt_var`` become ``value(response) -
            calibration_factor * value(reference)``, the reference answer scored as the response
            by the same ensemble (items without a reference keep the plain values; ``members``
            stay the response's own, the reference's are in ``reference_members``).
        calibration_factor: the factor of ``"calibrate"``.
        **kwargs: passed to ``glassbox`` (``backend``, ``mode``, ``use_chat_template``, ...).

    Returns:
        per item ``{"unt_exp", "unt_var", "members": [P_m per prompt]}``.
    """
    pool = list(system_prompts) if system_prompts is not None else default_system_prompts()
    if not pool:
        raise ValueError("system_prompts must hold at least one prompt")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if reference not in (None, "illustrate", "calibrate"):
        raise ValueError(f"reference must be None, 'illustrate' or 'calibrate', got {reference!r}")
    kwargs.pop("system_prompt", None)  # replaced by each pool member
    its = [as_item(x) for x in items]
    if reference == "illustrate":
        its = [illustrate(it) for it in its]
    elif reference == "calibrate":
        scored, has_ref = with_references(its)
        rows = prompt_ensemble(model, tokenizer, scored, system_prompts=pool,
                               batch_size=batch_size, **kwargs)
        res = []
        for row, rr in pair_references(rows, has_ref):
            if rr is not None:
                for k in ("unt_exp", "unt_var"):
                    row[k] = row[k] - calibration_factor * rr[k]
                row["reference_members"] = rr["members"]
            res.append(row)
        return res
    m = len(pool)
    res = []
    for s in range(0, len(its), batch_size):
        group = [replace(it, system_prompt=sp) for it in its[s:s + batch_size] for sp in pool]
        # One glassbox call whose batch is the whole group: exactly one padded forward.
        rows = glassbox(model, tokenizer, group, features=["sent_logprob"],
                        batch_size=len(group), **kwargs)
        res += [_summary([r["sent_logprob"] for r in rows[i * m:(i + 1) * m]])
                for i in range(len(group) // m)]
    return res


@torch.no_grad()
def sample_responses(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, item: Any, *,
                     k: int = 5, seed: int = 0,
                     max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                     system_prompt: str | None = None, use_chat_template: bool | None = None
                     ) -> list[str]:
    """``k`` responses to the item's instruction, sample ``j`` drawn under ``seed + j``."""
    it = as_item(item)
    enc = encode(tokenizer, replace(it, response=""), system_prompt, use_chat_template)
    ids = torch.tensor([enc.ids], dtype=torch.long, device=model_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for j in range(k):
        torch.manual_seed(seed + j)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=temperature, top_p=top_p, top_k=0,
                             max_new_tokens=max_new_tokens, pad_token_id=pad)
        new = gen[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id in new:
            new = new[:new.index(tokenizer.eos_token_id)]
        out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


def decoding_ensemble(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                      items: Sequence[Any], *, k: int = 5,
                      seed: int = 0, max_new_tokens: int = 64, temperature: float = 1.0,
                      top_p: float = 1.0, system_prompt: str | None = None,
                      use_chat_template: bool | None = None, **kwargs: Any
                      ) -> list[dict[str, Any]]:
    """``unt_exp`` / ``unt_var`` over ``k`` sampled responses per item (module docstring).

    Returns:
        per item ``{"unt_exp", "unt_var", "members": [P_j], "samples": [text_j]}``.
    """
    its = [as_item(x) for x in items]
    samples = [sample_responses(model, tokenizer, it, k=k, seed=seed,
                                max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, system_prompt=system_prompt,
                                use_chat_template=use_chat_template) for it in its]
    expanded = [replace(it, response=s) for it, ss in zip(its, samples, strict=True) for s in ss]
    rows = glassbox(model, tokenizer, expanded, features=["sent_logprob"],
                    system_prompt=system_prompt, use_chat_template=use_chat_template, **kwargs)
    res = []
    for i in range(len(its)):
        d = _summary([r["sent_logprob"] for r in rows[i * k:(i + 1) * k]])
        d["samples"] = samples[i]
        res.append(d)
    return res
