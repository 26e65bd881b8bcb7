"""``python -m bench.gpu_model.static --e2e``: ICQS throughput of a 7B Llama-family model on
one H100, on paper, from the forward's FLOPs and bytes, with the prefix bank and the naive way.

ICQS scores one response under ``(M+1) x L`` demonstration contexts (``M+1`` ratios, ``L`` sets
of ``demos`` demonstrations each). Naive: every (response, context) pair is its own forward
over ``context + suffix`` tokens. Prefix bank: each context is forwarded once (its KV kept) and
every response runs only its suffix, attending to the stored prefix.

Per token of a forward: linear FLOPs ``2 * P`` (``P`` = parameters less the input embedding;
the LM head included), attention FLOPs ``4 * layers * hidden * keys`` (QK^T and PV over the
keys the token sees), and the memory-bound per-token work (norms, RoPE, SiLU-mul, residuals)
as bytes. Times: linear FLOPs at the measured bf16 matmul rate (798 TFLOP/s); attention at
FlashAttention-3's published causal d=128 rate (579 TFLOP/s, optimistic end) or the Triton
tutorial's (353 TFLOP/s, pessimistic end) from the FA3 paper's figure; the per-token
elementwise bytes at 3.0 TB/s only at the pessimistic end (unfused). Weight reads (13.5 GB per
forward batch) are amortised over a batch of ``batch_tokens`` tokens.

Lengths are assumptions (``E2E_DEFAULTS``): a demonstration of ``demo_tokens`` (query + answer),
a scored suffix of ``suffix_tokens`` (query + the response), ``response_tokens`` of which are
scored. Override them with keyword arguments of :func:`icqs_throughput`.
"""

from __future__ import annotations

from typing import Any

from bench.gpu_model import model as gpu_model

# Llama-2-7B (meta-llama/Llama-2-7b-hf config.json): 32 layers, hidden 4096, MLP 11008, 32
# heads (no GQA), vocabulary 32000.
LLAMA_7B = {"name": "Llama-2-7B", "layers": 32, "hidden": 4096, "mlp": 11008, "heads": 32,
            "kv_heads": 32, "vocab": 32000}
E2E_DEFAULTS = {"ratios": 5, "sets": 4, "demos": 8, "demo_tokens": 160, "suffix_tokens": 256,
                "response_tokens": 192, "responses": 10000, "batch_tokens": 16384}
# FlashAttention-3 paper figure (Dao-AILab/flash-attention assets/flash3_fp16_fwd.png), H100,
# causal, head dim 128, seqlen 4k: FA3 579 TFLOP/s, Triton tutorial 353 TFLOP/s.
ATTN_TFLOPS = {"low": 579e12, "high": 353e12}
# Unfused elementwise traffic per token per layer, in units of hidden-size bf16 vectors:
# 2 RMSNorms (read + write), RoPE on q and k, SiLU-mul (3 MLP-size vectors), 2 residual adds.
ELEMENTWISE_VECTORS = {"hidden": 2 * 2 + 2 * 2 + 2 * 3, "mlp": 3}
VLLM_REFERENCE = {
    "tokens_per_s": None,
    "note": ("no published vLLM prefill-only throughput for a 7B model on one H100 was found in "
             "the stored sources searched (vLLM issues / docs / blog pages); the comparable "
             "figure printed is this model's plain prefill of the same token counts "
             "(plain_prefill_tokens_per_s)"),
}


def _params(m: dict[str, int]) -> int:
    h, f, v, n = m["hidden"], m["mlp"], m["vocab"], m["layers"]
    kv = h * m["kv_heads"] // m["heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f
    return n * per_layer + v * h  # + LM head; the input embedding is a lookup


def forward_seconds(tokens: float, attn_keys: float, *, end: str, hw=None,
                    model: dict[str, int] = LLAMA_7B, batch_tokens: int = 16384) -> float:
    """Seconds for ``tokens`` forward tokens that together attend to ``attn_keys`` keys
    (sum over tokens of the keys each sees), at ``end`` = ``"low"`` or ``"high"``."""
    hw = hw or gpu_model.hardware("sm_90")
    p = _params(model)
    lin = 2 * p * tokens / hw.tensor_bf16_achievable
    attn = 4 * model["layers"] * model["hidden"] * attn_keys / ATTN_TFLOPS[end]
    weights = p * 2 * tokens / batch_tokens / hw.hbm_achievable
    t = max(lin, weights) + attn
    if end == "high":
        vec = (ELEMENTWISE_VECTORS["hidden"] * model["hidden"]
               + ELEMENTWISE_VECTORS["mlp"] * model["mlp"])
        t += model["layers"] * vec * 2 * tokens / hw.hbm_achievable
    return t


def icqs_throughput(**overrides: Any) -> dict[str, Any]:
    """Predicted ICQS throughput (responses/s, tokens/s) on one H100 for the prefix-bank and
    the naive way, each at the optimistic (``low`` time) and pessimistic (``high``) end.

    Returns a JSON-able dict: the settings, FLOPs per response, and per way and end
    ``seconds_per_response``, ``responses_per_s``, ``scored_tokens_per_s`` (response tokens
    scored under all contexts per second), ``forward_tokens_per_s``; ``speedup`` of the
    prefix bank; the plain-prefill rate of the same model and the vLLM reference.
    """
    s = {**E2E_DEFAULTS, **overrides}
    contexts = s["ratios"] * s["sets"]
    ctx = s["demos"] * s["demo_tokens"]
    suf = s["suffix_tokens"]
    # Keys seen: a causal run of T tokens sees T(T+1)/2 in all; a suffix after a prefix of
    # ctx tokens sees ctx each plus its own causal part.
    naive_keys = contexts * (ctx + suf) * (ctx + suf + 1) / 2
    naive_tokens = contexts * (ctx + suf)
    bank_keys = contexts * (suf * ctx + suf * (suf + 1) / 2)
    bank_tokens = contexts * suf
    # The bank's contexts are forwarded once for all responses.
    prefix_tokens = contexts * ctx / s["responses"]
    prefix_keys = contexts * ctx * (ctx + 1) / 2 / s["responses"]
    out: dict[str, Any] = {"model": LLAMA_7B["name"], "device": gpu_model.hardware("sm_90").name,
                           "settings": s, "contexts_per_response": contexts,
                           "context_tokens": ctx, "vllm_reference": VLLM_REFERENCE}
    p = _params(LLAMA_7B)
    out["flops_per_response"] = {
        "naive": 2 * p * naive_tokens + 4 * LLAMA_7B["layers"] * LLAMA_7B["hidden"] * naive_keys,
        "prefix_bank": (2 * p * (bank_tokens + prefix_tokens) + 4 * LLAMA_7B["layers"]
                        * LLAMA_7B["hidden"] * (bank_keys + prefix_keys))}
    for way, (tok, keys) in {"naive": (naive_tokens, naive_keys),
                             "prefix_bank": (bank_tokens + prefix_tokens,
                                             bank_keys + prefix_keys)}.items():
        out[way] = {}
        for end in ("low", "high"):
            sec = forward_seconds(tok, keys, end=end, batch_tokens=s["batch_tokens"])
            out[way][end] = {"seconds_per_response": sec, "responses_per_s": 1 / sec,
                             "scored_tokens_per_s": s["response_tokens"] / sec,
                             "forward_tokens_per_s": tok / sec}
    out["speedup"] = {end: out["naive"][end]["seconds_per_response"]
                      / out["prefix_bank"][end]["seconds_per_response"] for end in ("low", "high")}
    # A plain prefill of prompts of ctx + suf tokens, for the comparison with serving engines.
    t = ctx + suf
    out["plain_prefill_tokens_per_s"] = {
        end: t / forward_seconds(t, t * (t + 1) / 2, end=end, batch_tokens=s["batch_tokens"])
        for end in ("low", "high")}
    return out


def print_e2e(res: dict[str, Any]) -> None:
    """Human-readable summary of :func:`icqs_throughput`."""
    s = res["settings"]
    print(f"{res['model']} on {res['device']}: {res['contexts_per_response']} contexts "
          f"(M+1={s['ratios']} x L={s['sets']}) of {s['demos']} demos = {res['context_tokens']} "
          f"tokens; suffix {s['suffix_tokens']} tokens, {s['response_tokens']} scored")
    for way in ("naive", "prefix_bank"):
        lo, hi = res[way]["low"], res[way]["high"]
        print(f"  {way:12} {hi['responses_per_s']:8.2f} - {lo['responses_per_s']:8.2f} responses/s"
              f"  {hi['forward_tokens_per_s']:9.0f} - {lo['forward_tokens_per_s']:9.0f} "
              f"forward tokens/s")
    print(f"  prefix bank speed-up {res['speedup']['high']:.1f}x - {res['speedup']['low']:.1f}x;"
          f" plain prefill {res['plain_prefill_tokens_per_s']['high']:.0f} - "
          f"{res['plain_prefill_tokens_per_s']['low']:.0f} tokens/s")
    print(f"  vLLM reference: {res['vllm_reference']['note']}")
