"""The capability check: one decision per model of how the engine runs it, said once.

Every scoring path (ICQS, continuations, glass-box features, the server) asks
:func:`model_plan` and follows its answer:

* **body and head**: the decoder body whose output the LM head reads, and the head's logit
  epilogue (:class:`~icqs_fast.engine.layout.HeadEpilogue`: a logit scale, final-logit
  softcapping), found from one 4-token forward of the model itself: the head's input is captured
  by a hook, a scale is fitted and snapped to a config value when one matches, and the fused head
  plus epilogue must reproduce the model's own log-probabilities. A head that nothing here
  reproduces is not refused: such a model is scored from its own logits (plain path).
* **path**: ``"cascade"`` (prefix bank + cascade attention), ``"kv-copy"`` (prefix bank + a
  per-row KV cache) or ``"plain"`` (one right-padded forward per prompt, no prefix sharing:
  exact, slower). The bank paths are tried in that order on a probe (shared and padded prefixes,
  longer than the model's windows where they are short) and taken only when the probe's hidden
  states match the model's plain forward; models with layers that are not attention (Mamba,
  RWKV, hybrids: their state is not in the bank) go straight to the plain path.

The decision and its reason are in :attr:`ModelPlan.message` (e.g. ``"gemma2: prefix bank,
cascade attention, sliding-window masks (16 tokens, 1 of 2 layers), attention softcapping,
final-logit softcapping 30"``; ``"mamba: plain forward, no prefix sharing (2 of 2 layers
without attention (linear_attention))"``), logged once per model on the ``icqs_fast`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import ops
from icqs_fast.engine.batching import (
    PrefixBank,
    last_hidden,
    model_device,
    right_padded,
    suffix_hidden,
)
from icqs_fast.engine.layout import (
    HeadEpilogue,
    LayerAttention,
    describe_layers,
    final_softcap,
    layer_attention,
    text_config,
)
from icqs_fast.invariant_linears import exact_bf16_products
from icqs_fast.models import bf16_matmuls, is_bf16_mixed, uses_bf16_products
from icqs_fast.types import TokenStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("icqs_fast")

# Largest |log_softmax difference| accepted between the fused head (+ epilogue) and the model's
# own logits, relative to max(1, max |logit|): the fused head computes in fp32 from the body's
# hidden states while the model's lm_head rounds its logits to the model dtype (bf16: 2^-8
# relative), so the tolerance follows the dtype.
HEAD_CHECK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 8e-3,
                   torch.bfloat16: 4e-2}
# Largest |hidden-state difference| of the bank probe against the plain forward, relative to
# max(1, max |h|). fp32: the cascade merge and padded matmuls round differently (~1e-6); 16-bit
# states differ by a few units of the last place per layer. A wrong mask (a window off by one, a
# missing prefix) moves states by a sizeable fraction of their scale.
PROBE_RTOL = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 3e-2,
              torch.bfloat16: 6e-2}
# Probe prefixes run past the model's windows / chunks up to this many tokens (a 4096-token
# window is not crossed: the window masks are checked on small windows by the tests).
PROBE_MAX_TOKENS = 80


@dataclass
class ModelPlan:
    """How the engine runs one model (:func:`model_plan`).

    Attributes:
        model_type: the config's ``model_type``.
        path: ``"cascade"``, ``"kv-copy"`` or ``"plain"``.
        layers: each decoder layer's :class:`~icqs_fast.engine.layout.LayerAttention`.
        head: the LM head's logit epilogue.
        body: the module whose output the head reads (None when :attr:`own_logits`).
        own_logits: the head is not a linear layer + epilogue this package reproduces: scores
            come from the model's own logits (plain path only).
        pad_safe: right padding leaves the real tokens' states unchanged (plain path: else each
            prompt runs in a forward of its own).
        reason: why the path is not the prefix bank (empty when it is).
        probe_diff: the bank probe's relative hidden-state difference (None when not probed).
        probe_errors: each probe that raised, as ``"path: Type: message"`` (a Triton compile
            or launch error, an out-of-memory error): why a faster path was not taken.
        slower_because: on the KV-copy path, what the cascade probe gave instead.
    """

    model_type: str
    path: str
    layers: tuple[LayerAttention, ...]
    head: HeadEpilogue
    body: Any
    own_logits: bool = False
    pad_safe: bool = True
    reason: str = ""
    probe_diff: float | None = None
    probe_errors: tuple[str, ...] = ()
    slower_because: str = ""
    signature: tuple = field(default=(), repr=False)

    @property
    def fastest(self) -> bool:
        """Whether this is the fastest path (cascade attention over the prefix bank)."""
        return self.path == "cascade"

    @property
    def why_not_fastest(self) -> str:
        """Why the path is not cascade attention ("" when it is): the probes' errors or
        differences and, on the plain path, its reason."""
        if self.fastest:
            return ""
        why = self.slower_because or self.reason or "; ".join(self.probe_errors)
        return why or "the cascade probe did not match the plain forward"

    def as_meta(self, backend: str) -> dict[str, Any]:
        """The plan for a run's meta file: the path, the kernel ``backend`` of the head
        statistics (resolved, not ``auto``), what the path uses, and why it is not the fastest
        one (empty when it is)."""
        return {"path": self.path, "backend": backend, "model_type": self.model_type,
                "uses": self.uses, "fastest": self.fastest, "why": self.why_not_fastest,
                "probe_diff": self.probe_diff, "probe_errors": list(self.probe_errors),
                "message": self.message}

    @property
    def bank(self) -> bool:
        """Whether the prefix bank serves this model (cascade or KV-copy path)."""
        return self.path != "plain"

    @property
    def positional_layers(self) -> tuple[LayerAttention, ...] | None:
        """The layer descriptions the engine's plain forwards run their attention on
        (:func:`icqs_fast.engine.batching.plain_hidden`: the positional kernel, as the bank's
        forwards, so a row's bits do not depend on its prefix being shared) for a model the
        bank serves; None for a plain-path model, which keeps its own attention (the probes
        found the bank's forwards do not reproduce it)."""
        return tuple(self.layers) if self.bank and self.layers else None

    @property
    def uses(self) -> str:
        """What the path uses beyond plain causal attention and a plain head, e.g.
        ``"sliding-window masks (16 tokens, 1 of 2 layers), final-logit softcapping 30"``."""
        parts = describe_layers(self.layers) + self.head.describe()
        if self.own_logits:
            parts.insert(0, "the model's own logits")
        if not self.pad_safe:
            parts.append("one prompt per forward")
        return ", ".join(parts)

    @property
    def why_not_bank(self) -> str:
        """A short, stable reason why the prefix bank does not serve the model ("" when it
        does): ``"layers without attention"``, ``"head not reproduced"`` or ``"bank probe
        failed"``."""
        if self.path != "plain":
            return ""
        if self.own_logits:
            return "head not reproduced"
        if any(la.kind == "none" for la in self.layers):
            return "layers without attention"
        return "bank probe failed"

    @property
    def message(self) -> str:
        """One line naming the path and what it uses, e.g. ``"gemma2: prefix bank, cascade
        attention, sliding-window masks (...), final-logit softcapping 30"``."""
        if self.path == "plain":
            parts = ["plain forward, no prefix sharing"]
            if self.own_logits:
                parts.append("scored from the model's own logits")
            if not self.pad_safe:
                parts.append("one prompt per forward (right padding changes its states)")
            parts += describe_layers(self.layers) + self.head.describe()
            if self.reason:
                parts.append(f"because {self.reason}")
        else:
            parts = ["prefix bank", "cascade attention" if self.path == "cascade"
                     else "per-row KV copies"]
            parts += describe_layers(self.layers) + self.head.describe()
        return f"{self.model_type}: {', '.join(parts)}"

    def head_stats(self, hidden: torch.Tensor, targets: torch.Tensor, backend: str = "auto"
                   ) -> TokenStats:
        """Fused LM-head statistics (:func:`icqs_fast.ops.linear_token_stats` with the head's
        epilogue) of ``hidden [N, H]`` (the body's final states) at ``targets [N]`` int64."""
        if self.own_logits:
            raise RuntimeError(f"{self.model_type}: its head is scored from the model's own "
                               "logits, not from hidden states")
        return head_stats(self._model_head(), self.head, hidden, targets, backend)

    def _model_head(self) -> Any:
        model = self._model() if self._model is not None else None
        if model is None:
            raise RuntimeError("the model of this plan is gone")
        return model.get_output_embeddings()

    _model: Any = field(default=None, repr=False)


def head_stats(head: Any, epilogue: HeadEpilogue, hidden: torch.Tensor, targets: torch.Tensor,
               backend: str = "auto") -> TokenStats:
    """:func:`icqs_fast.ops.linear_token_stats` through a linear ``head`` and its epilogue (the
    head of a ``bf16-mixed`` model on oneDNN's fp32 kernels, as its linear layers:
    :func:`icqs_fast.models.bf16_matmuls`)."""
    kw: dict[str, Any] = {}
    if epilogue.logit_scale != 1.0:
        kw["logit_scale"] = epilogue.logit_scale
    if epilogue.softcap is not None:
        kw["softcap"] = epilogue.softcap
    if is_bf16_mixed(head):
        # A bf16-valued head: exact products where they are faster (AMX), fp32 ones elsewhere.
        kw["products"] = exact_bf16_products()
    w = dense_head_weight(head)
    if hidden.device != w.device:  # a split model (--device-map auto): the head's own device
        hidden, targets = hidden.to(w.device), targets.to(w.device)
    with bf16_matmuls() if is_bf16_mixed(head) else contextlib.nullcontext():
        return ops.linear_token_stats(hidden, w, targets,
                                      bias=getattr(head, "bias", None), backend=backend, **kw)


# The attribute of a quantised head weight that holds its dense copy (made once; a reloaded or
# re-quantised head is a new parameter without it).
_DENSE_ATTR = "_icqs_fast_dense"


DENSE_ROWS = 1024  # identity rows per forward of the quantised head (bounds its peak memory)


@torch.no_grad()
def dense_head_weight(head: Any) -> torch.Tensor:
    """The ``[V, H]`` weight of the LM ``head`` as the fused statistics read it: the weight
    itself, or for a bitsandbytes head (``Int8Params``, ``Params4bit``) its dense copy, made
    once per weight (a 7B model's 32000 x 4096 head: 250 MiB in fp16). The copy is the head's
    own forward of the identity, ``head(I) - bias = W^T``: exactly what bitsandbytes multiplies
    by, whatever its storage layout (the CPU's repacked NF4, LLM.int8's row scales; an identity
    row quantises exactly, below the outlier threshold), so the head probe matches the model's
    logits and the prefix bank keeps serving a quantised head."""
    w = head.weight
    if type(w).__name__ not in ("Int8Params", "Params4bit"):
        return w
    dense = getattr(w, _DENSE_ATTR, None)
    if dense is None:
        h = int(head.in_features)
        dt = getattr(head, "compute_dtype", None) or torch.float16
        bias = getattr(head, "bias", None)
        parts = []
        for a in range(0, h, DENSE_ROWS):
            eye = torch.zeros(min(DENSE_ROWS, h - a), h, dtype=dt, device=w.device)
            eye.diagonal(a).fill_(1)
            out = head(eye)
            parts.append(out if bias is None else out - bias.to(out.dtype))
        dense = torch.cat(parts).t().contiguous()
        setattr(w, _DENSE_ATTR, dense)
    return dense


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def _signature(model: PreTrainedModel) -> tuple:
    head = model.get_output_embeddings()
    w = getattr(head, "weight", None)
    p = next(model.parameters())
    return (p.dtype, p.device, None if w is None else (w.data_ptr(), tuple(w.shape)),
            model.config._attn_implementation)


def model_plan(model: PreTrainedModel) -> ModelPlan:
    """The engine's plan for ``model`` (see the module docstring), decided on first use and
    cached per model object (re-decided when its dtype, device, head weight or attention
    implementation changes). Logs :attr:`ModelPlan.message` once per decision.

    Raises:
        TypeError: the model has no output embeddings at all (not a causal LM).
    """
    with _LOCK:
        sig = _signature(model)
        plan = _PLANS.get(model)
        if plan is not None and plan.signature == sig:
            return plan
        was_training = getattr(model, "training", False)
        model.eval()
        try:
            plan = _decide(model)
        finally:
            if was_training:
                model.train()
        plan.signature = sig
        plan._model = weakref.ref(model)
        _PLANS[model] = plan
        # A slower path than cascade attention is said where the CLI shows it (WARNING):
        # a compile, launch or out-of-memory error in a probe must not pass as a quiet step down.
        if plan.fastest:
            log.info("%s", plan.message)
        else:
            log.warning("%s (not the fastest path, cascade attention: %s)", plan.message,
                        plan.why_not_fastest)
        return plan


# --------------------------------------------------------------------------- the decision


def _check_ids(model: PreTrainedModel, v: int) -> torch.Tensor:
    bos = getattr(text_config(model.config), "bos_token_id", None)
    first = int(bos) if isinstance(bos, int) and 0 <= bos < v else 0
    return torch.tensor([[first, 1 % v, v // 2, v - 1]], device=model_device(model))


# Config names that may hold a logit scale (Cohere logit_scale, Granite logits_scaling, ...).
_SCALE_NAME = re.compile(r"scale|scaling|multiplier|temperature|logit|dim_model_base")


def _scale_candidates(cfg: Any) -> list[tuple[float, str]]:
    """Config values a logit scale may be (scale-like names): each and its reciprocal."""
    out = []
    for c in {id(cfg): cfg, id(text_config(cfg)): text_config(cfg)}.values():
        for k, v in c.to_dict().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and \
                    math.isfinite(v) and _SCALE_NAME.search(k):
                out.append((float(v), k))
                out.append((1.0 / float(v), f"1/{k}"))
    return out


def _fit_scale(z: torch.Tensor, target: torch.Tensor) -> float:
    """Least-squares ``a`` with ``target ~ a z + c_row`` (a per-row shift changes nothing)."""
    zc = z - z.mean(-1, keepdim=True)
    tc = target - target.mean(-1, keepdim=True)
    den = float((zc * zc).sum())
    return float((zc * tc).sum()) / den if den > 0 else 1.0


def _log_softmax_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max())


def _fit_epilogue(cfg: Any, z: torch.Tensor, logits: torch.Tensor, tol: float
                  ) -> HeadEpilogue | None:
    """The epilogue that turns the fused head's ``z`` into the model's ``logits`` (both
    ``[T, V]`` fp32 in float64 here), or None."""
    z, logits = z.double(), logits.double()
    if _log_softmax_diff(z, logits) <= tol:
        return HeadEpilogue()
    caps: list[float | None] = [None]
    c = final_softcap(cfg)
    if c is not None:
        caps.insert(0, c)
    for cap in caps:
        target = logits
        if cap is not None:
            ratio = (logits / cap).clamp(-0.999999, 0.999999)
            target = torch.atanh(ratio) * cap
        a = _fit_scale(z, target)
        src = ""
        for cand, name in _scale_candidates(cfg):
            if abs(cand - a) <= 1e-4 * abs(a):
                a, src = cand, name
                break
        if not math.isfinite(a) or a == 0:
            continue
        ep = HeadEpilogue(logit_scale=1.0 if src == "" and abs(a - 1) < 1e-6 else a,
                          softcap=cap, source=src or ("fitted" if abs(a - 1) >= 1e-6 else ""))
        if _log_softmax_diff(ep.apply(z), logits) <= tol:
            return ep
    return None


def _body_candidates(model: PreTrainedModel) -> list[Any]:
    """Modules that may be the decoder body: the base model (when it is not the model itself)
    and the usual attribute names one and two levels down (OPT's head reads
    ``model.decoder``; some causal-LM classes are their own ``base_model``)."""
    names = ("model", "decoder", "transformer", "language_model", "text_model", "backbone")
    out: list[Any] = []
    base = getattr(model, "base_model", None)
    tops = [base] if base is not None and base is not model else []
    tops += [getattr(model, n, None) for n in names]
    for top in tops:
        if not isinstance(top, torch.nn.Module) or top is model:
            continue
        for m in [top] + [getattr(top, n, None) for n in names]:
            if isinstance(m, torch.nn.Module) and m is not model and \
                    all(m is not o for o in out):
                out.append(m)
    return out


@torch.no_grad()
def _find_head(model: PreTrainedModel) -> tuple[Any, HeadEpilogue, str]:
    """``(body, epilogue, why)``: the body whose output is (proportional to) what the head reads,
    and the epilogue fitted on that output (so a scale between body and head is in its logit
    scale); body None (and ``why``) when no candidate works."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise TypeError(f"{type(model).__name__} has no linear output embeddings (LM head)")
    w = dense_head_weight(head)
    v = int(w.shape[0])
    ids = _check_ids(model, v)
    seen: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        hook.remove()
    h_in = seen[-1][0] if seen else None
    scale = max(1.0, float(logits.abs().max()))
    tol = HEAD_CHECK_RTOL.get(w.dtype, 4e-2) * scale
    cfg = model.config
    for body in _body_candidates(model):
        try:
            hb = last_hidden(body(input_ids=ids, use_cache=False))[0].float()
        except Exception:  # noqa: BLE001 - a candidate that cannot run on input_ids is not it
            continue
        if hb.shape[-1] != w.shape[1]:
            continue
        if h_in is not None and h_in.shape == hb.shape and not torch.allclose(
                hb, h_in.float(), rtol=1e-3, atol=1e-5):
            # Not the head's input itself: a candidate only if proportional to it (MiniCPM).
            k = _fit_scale(hb.reshape(1, -1), h_in.float().reshape(1, -1))
            if not torch.allclose(hb * k, h_in.float(), rtol=1e-3, atol=1e-4):
                continue
        z = hb @ w.float().t()
        if getattr(head, "bias", None) is not None:
            z = z + head.bias.float()
        ep = _fit_epilogue(cfg, z, logits, tol)
        if ep is not None:
            return body, ep, ""
    why = ("its logits are not a linear head (+ scale / softcap) on a decoder body's output "
           "that this package can run")
    return None, HeadEpilogue(), why


@torch.no_grad()
def _probe(model: PreTrainedModel, body: Any, layers: tuple[LayerAttention, ...],
           cascade: bool) -> float:
    """Relative max difference of the bank path's suffix hidden states from the body's plain
    forward over the whole texts, on shared, padded prefixes that cross short windows."""
    v = int(dense_head_weight(model.get_output_embeddings()).shape[0])
    spans = [la.window or la.chunk or 0 for la in layers if la.local]
    base = min(max([24] + [2 * s + 5 for s in spans]), PROBE_MAX_TOKENS)
    g = torch.Generator().manual_seed(0)
    hi = max(2, min(v, 32000))
    tok = lambda n: torch.randint(1, hi, (n,), generator=g).tolist()  # noqa: E731
    a = tok(base)
    b = a[: base - 7] + tok(4)
    c = a[:5]
    prefixes = [a, b, c]
    rows = [(0, tok(6)), (0, tok(11)), (1, tok(9)), (2, tok(3))]
    pad = 0
    bank = PrefixBank(model, pad, 4096, body=body, layers=layers)
    entries = bank.add(prefixes)
    hidden, _ = suffix_hidden(model, bank, [entries[p] for p, _ in rows], [s for _, s in rows],
                              pad, cascade=cascade)
    worst = 0.0
    dev = model_device(model)
    for i, (p, s) in enumerate(rows):
        # The model's own forward: an independent check of the bank path (and of the positional
        # kernel it shares with the engine's plain forwards of bank-path models).
        full = torch.tensor([prefixes[p] + s], device=dev)
        ref = last_hidden(body(input_ids=full, use_cache=False))[0, len(prefixes[p]):].float()
        got = hidden[i, : len(s)].float()
        d = float((got - ref).abs().max()) / max(1.0, float(ref.abs().max()))
        worst = max(worst, d if math.isfinite(d) else math.inf)
    return worst


@torch.no_grad()
def _pad_probe(model: PreTrainedModel, body: Any) -> bool:
    """Whether a right-padded batch gives each real token the states (or logits) it has alone:
    two rows of 12 and 7 tokens, the shorter padded, against each run alone."""
    v = int(dense_head_weight(model.get_output_embeddings()).shape[0])
    g = torch.Generator().manual_seed(1)
    hi = max(2, min(v, 32000))
    rows = [torch.randint(1, hi, (n,), generator=g).tolist() for n in (12, 7)]
    dev = model_device(model)
    run = (lambda ids, mask: model(input_ids=ids, attention_mask=mask, use_cache=False).logits) \
        if body is None else \
        (lambda ids, mask: last_hidden(body(input_ids=ids, attention_mask=mask, use_cache=False)))
    ids, mask = right_padded(rows, 0)
    both = run(ids.to(dev), mask.to(dev)).float()
    tol = PROBE_RTOL.get(next(model.parameters()).dtype, 6e-2)
    for i, r in enumerate(rows):
        alone = run(torch.tensor([r], device=dev), torch.ones(1, len(r), dtype=torch.long,
                                                              device=dev))[0].float()
        d = float((both[i, : len(r)] - alone).abs().max()) / max(1.0, float(alone.abs().max()))
        if not d <= tol:
            return False
    return True


def _error(path: str, exc: BaseException) -> str:
    """A probe's exception as ``"path: Type: first line"`` (for the plan and the log)."""
    first = (str(exc).splitlines() or [""])[0][:160]
    return f"{path}: {type(exc).__name__}: {first}"


def _plain(mt: str, layers: tuple, ep: HeadEpilogue, body: Any, model: PreTrainedModel,
           probe_errors: tuple[str, ...] = (), **kw: Any) -> ModelPlan:
    try:
        safe = _pad_probe(model, body)
    except Exception as exc:  # noqa: BLE001 - a model that fails padded batches runs rows alone
        safe = False
        probe_errors = (*probe_errors, _error("padding", exc))
    return ModelPlan(mt, "plain", layers, ep, body, pad_safe=safe, probe_errors=probe_errors,
                     **kw)


def _decide(model: PreTrainedModel) -> ModelPlan:
    cfg = model.config
    mt = str(getattr(cfg, "model_type", None) or type(model).__name__)
    layers = layer_attention(cfg)
    body, ep, why = _find_head(model)
    if body is None:
        return _plain(mt, layers, ep, None, model, own_logits=True, reason=why)
    none = [la for la in layers if la.kind == "none"]
    if none:
        return _plain(mt, layers, ep, body, model,
                      reason="the prefix bank holds attention keys/values only")
    dtype = next(model.parameters()).dtype
    # bf16-products rounds its products' inputs to bf16 (the model's own forward takes fp32
    # attention): its bank path is held to bf16's tolerance.
    tol = PROBE_RTOL.get(torch.bfloat16 if uses_bf16_products(model) else dtype, 6e-2)
    reasons = []
    errors: list[str] = []
    diff = None
    for path in ("cascade", "kv-copy"):
        try:
            diff = _probe(model, body, layers, cascade=path == "cascade")
        except Exception as exc:  # noqa: BLE001 - any failure means: not this path (reported)
            errors.append(_error(path, exc))
            reasons.append(errors[-1])
            continue
        if diff <= tol:
            return ModelPlan(mt, path, layers, ep, body, probe_diff=diff,
                             probe_errors=tuple(errors), slower_because="; ".join(reasons))
        reasons.append(f"{path}: differs from a plain forward by {diff:.2g} (relative)")
    return _plain(mt, layers, ep, body, model, probe_diff=diff, probe_errors=tuple(errors),
                  reason="the prefix-bank probe failed (" + "; ".join(reasons) + ")")
