"""The invariance matrix: a row's numbers are the same bits (``torch.equal``) whatever shares its
forward - alone, inside batches of mixed lengths, sharing prefixes with its neighbours (so it
runs as a suffix of the prefix bank, cut anywhere), prefilled in chunks, under other token
budgets, at 1 and 2 threads - for every CPU dtype and every ISA path of the C++ kernels
(``ICQS_FAST_CPP_ISA``; the AMX branch of bf16-mixed's products reached through a patched
probe on CPUs without AMX). Read from the three places a user reads numbers: the server's echo
log-probs, the ICQS engine's log-likelihoods and the lm-eval backend's.

The tiny random Llama keeps this in the fast tier; the embedded model's 215-token passage is
measured by ``bench icqs`` / docs/BACKENDS.md.
"""

from __future__ import annotations

import pytest
import torch

from icqs_fast import invariant_linears, models
from icqs_fast.backends import cpp_backend

DTYPES = ("float32", "bf16-mixed", "bf16-products", "bfloat16")


def _isas() -> list[str]:
    ok, _ = cpp_backend.available()
    if not ok:
        return ["auto"]
    best = cpp_backend._C.best_isa()
    return ["auto"] + [name for name, lvl in (("avx2", 1), ("avx512", 2)) if lvl <= best]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    d = tiny_llama_dir(layers=2)
    cache: dict[str, tuple] = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = models.load_model(d, dtype=dtype, device="cpu")
        return cache[dtype]
    return get


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4000, (n,), generator=g).tolist()


def _echo(model, prompts, **kw) -> list[torch.Tensor]:
    from icqs_fast.serve.logprobs import prompt_logprobs

    return [torch.tensor(r.token_logprobs) for r in prompt_logprobs(model, prompts, **kw)]


def _threads(n: int):
    class _T:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)
    return _T()


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", DTYPES)
def test_echo_logprobs_are_the_same_bits_whatever_shares_the_forward(loaded, dtype, isa,
                                                                     monkeypatch):
    from icqs_fast.serve.logprobs import PromptPrefill

    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    model, _ = loaded(dtype)
    target = _ids(140, 0)
    alone = _echo(model, [target])[0]
    others = [_ids(n, 10 + n) for n in (5, 37, 90, 200)]
    sharing = [target[:40] + _ids(30, 1), target[:120] + _ids(10, 2), target[:9] + _ids(3, 3)]
    cases = {
        "beside 4 others": _echo(model, others[:2] + [target] + others[2:])[2],
        "sharing 9/40/120 tokens": _echo(model, [sharing[0], target] + sharing[1:])[1],
    }
    if isa != "auto":  # the forced ISA paths: the two cases above (the kernels differ there)
        for name, got in cases.items():
            assert torch.equal(got, alone), (dtype, isa, name, (got - alone).abs().max().item())
        return
    cases["token budget 64"] = _echo(model, [target] + others, token_budget=64)[0]
    cases["64 rows"] = _echo(model, [_ids(3 + (5 * i) % 24, 100 + i) for i in range(63)]
                             + [target])[63]
    with _threads(1):
        cases["1 thread"] = _echo(model, [target])[0]
    with _threads(2):
        cases["2 threads"] = _echo(model, [sharing[1], target])[1]
    if PromptPrefill.supported(model):
        pf = PromptPrefill(model, target)
        while not pf.step(23):
            pass
        cases["prefilled in chunks of 23"] = torch.tensor(pf.result().token_logprobs)
    for name, got in cases.items():
        assert torch.equal(got, alone), (dtype, isa, name, (got - alone).abs().max().item())


GOOD = [("Review: a delight\nSentiment:", " positive"), ("Review: warm\nSentiment:", " positive")]
BAD = [("Review: a delight\nSentiment:", " negative"), ("Review: warm\nSentiment:", " negative")]
RESP = [("Review: the film was a quiet, patient study of grief.\nSentiment:", " positive"),
        ("Review: bad\nSentiment:", " negative and long " * 3), ("Q?", " A"),
        ("Review: " + "long " * 70 + "\nSentiment:", " mixed")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_logliks_are_the_same_bits_alone_batched_and_at_any_budget(loaded, dtype):
    from icqs_fast.engine.scorer import ICQSScorer

    model, tok = loaded(dtype)
    opts = dict(num_ratios=2, demos_per_set=1, sets_per_ratio=2, seed=0)
    alone = [next(iter(ICQSScorer(model, tok, GOOD, BAD, **opts).score([r]))) for r in RESP]
    batch = list(ICQSScorer(model, tok, GOOD, BAD, **opts).score(RESP))
    small = list(ICQSScorer(model, tok, GOOD, BAD, token_budget=48, **opts).score(RESP))
    for a, b, c in zip(alone, batch, small, strict=True):
        assert torch.equal(a.loglik, b.loglik) and torch.equal(a.loglik, c.loglik), dtype
        assert a.score == b.score == c.score


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_eval_logliks_are_the_same_bits_alone_and_batched(loaded, dtype):
    from lm_eval.api.instance import Instance

    from icqs_fast.compat.lm_eval import ICQSFastLM

    model, tok = loaded(dtype)
    lm = ICQSFastLM(model=model, tokenizer=tok)
    reqs = [(RESP[0][0], " positive"), (RESP[0][0], " negative, without any doubt"),
            ("Review: bad\nSentiment:", " negative"), ("x", " y"), (RESP[3][0], " mixed")]
    inst = [Instance("loglikelihood", {}, a, i) for i, a in enumerate(reqs)]
    batch = lm.loglikelihood(inst, disable_tqdm=True)
    for i in (0, 4):
        assert lm.loglikelihood(inst[i:i + 1], disable_tqdm=True)[0] == batch[i], (dtype, i)


def test_the_amx_branch_of_bf16_mixed_through_a_patched_probe(tiny_llama_dir, monkeypatch):
    """bf16-mixed multiplies with 3 bf16 terms where the kernel runs them on AMX
    (invariant_linears.exact_bf16_products); on a CPU without AMX the probe is patched so that
    branch runs (the kernel then takes the same products on its AVX-512 / AVX2 paths) and keeps
    the invariance."""
    monkeypatch.setattr(cpp_backend, "linear_level", lambda products: "amx")
    assert invariant_linears.exact_bf16_products() == "bf16x3"
    model, _ = models.load_model(tiny_llama_dir(layers=2), dtype="bf16-mixed", device="cpu")
    lin = model.model.layers[0].self_attn.q_proj
    assert invariant_linears.uses_packed_weights(lin)
    target = _ids(100, 7)
    alone = _echo(model, [target])[0]
    inside = _echo(model, [target[:70] + _ids(20, 8), target, _ids(33, 9)])[1]
    assert torch.equal(alone, inside)
