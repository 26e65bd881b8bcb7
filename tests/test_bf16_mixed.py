"""bf16-mixed, the CPU default where the CPU has native bf16 dot products
(:func:`icqs_fast.models.to_bf16_mixed`): the weights rounded to bf16, the norms kept, the oneDNN
bf16-products mode on only while the model (or its head statistics) runs and restored after,
even on an error; the AVX2-only choice untouched; and batch invariance at small scale on each
path a user reads numbers from: the engine (ICQS), the lm-eval backend and the server's echo
log-probs. On a CPU without bf16 dot products the mode computes plain fp32, so every check here
still holds (it then proves less).
"""

from __future__ import annotations

import pytest
import torch

from icqs_fast import invariant_linears, models

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Review: the film was a quiet, patient study of grief and friendship.\nSentiment:"
GOOD = [("Review: a delight\nSentiment:", " positive"), ("Review: warm\nSentiment:", " positive")]
BAD = [("Review: a delight\nSentiment:", " negative"), ("Review: warm\nSentiment:", " negative")]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    """The tiny Llama (2 layers) loaded twice: float32, and bf16-mixed."""
    d = tiny_llama_dir(layers=2)
    fp32, tok = models.load_model(d, dtype="float32", device="cpu")
    mixed, _ = models.load_model(d, dtype="bf16-mixed", device="cpu")
    return fp32, mixed, tok


def test_weights_rounded_norms_kept(tiny):
    fp32, mixed, _ = tiny
    assert models.is_bf16_mixed(mixed) and not models.is_bf16_mixed(fp32)
    assert models.is_bf16_mixed(mixed.get_output_embeddings())
    assert models.dtype_name(mixed) == "bf16-mixed" and models.dtype_name(fp32) == "float32"
    ref = dict(fp32.named_parameters())
    for name, p in mixed.named_parameters():
        assert p.dtype == torch.float32
        if p.dim() >= 2:  # bf16 values held in fp32, on 64-byte lines
            assert torch.equal(p, p.bfloat16().float()), name
            assert p.data_ptr() % 64 == 0, name
            assert torch.equal(p, ref[name].bfloat16().float()), name
        else:  # norms stay as loaded
            assert torch.equal(p, ref[name]), name


def test_tied_embeddings_stay_tied():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    models.to_bf16_mixed(model)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is emb and head.data_ptr() == emb.data_ptr() and head.data_ptr() % 64 == 0


def test_mode_on_only_inside_the_forward(tiny, monkeypatch):
    _, mixed, tok = tiny
    seen = []
    layer = mixed.model.layers[0].mlp.down_proj
    h = layer.register_forward_hook(
        lambda *_: seen.append(torch.backends.mkldnn.matmul.fp32_precision))
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            mixed(input_ids=ids)
        # The mode is switched on only where it keeps fp32 precision (bf16_mode_is_exact).
        assert seen == ["bf16" if models.bf16_mode_is_exact() else before]
        assert torch.backends.mkldnn.matmul.fp32_precision == before
        # An error inside the forward restores it too.
        def boom(*_):
            raise RuntimeError("boom")

        h2 = mixed.model.layers[1].register_forward_hook(boom)
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            mixed(input_ids=ids)
        h2.remove()
        assert torch.backends.mkldnn.matmul.fp32_precision == before
    finally:
        h.remove()


def _bf16_products() -> bool:
    """Whether torch's process-wide setting sends fp32 matmuls to oneDNN's bf16 fpmath mode now
    (on a CPU where that mode keeps fp32 precision: models.bf16_mode_is_exact)."""
    return torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_mode_keeps_fp32_precision_where_it_is_on():
    """bf16-mixed's fidelity rests on the mode rounding no operand: inside bf16_matmuls a product
    of the model's shapes with arbitrary fp32 weights (not bf16 values) and activations stays at
    fp32's error against float64 (~4e-7; bf16-rounded operands give ~2e-3)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(96, 576, generator=g), torch.randn(1536, 576, generator=g)
    ref = x.double() @ w.double().T
    with models.bf16_matmuls():
        y = torch.nn.functional.linear(x, w)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_mode_stays_off_where_it_would_round(monkeypatch):
    """A CPU whose oneDNN rounds fp32 operands to bf16 in the mode (AMX): bf16_matmuls leaves
    torch's setting alone, so the bf16-mixed model computes IEEE fp32."""
    monkeypatch.setattr(models, "_MODE_EXACT", None)
    monkeypatch.setattr(models, "_probe_mode_exact", lambda: False)
    old = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        with models.bf16_matmuls():
            assert not models.bf16_mode_is_exact()
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = old


def test_probe_tells_rounding_from_fp32(monkeypatch):
    """The probe itself: a linear that rounds its activations to bf16 (what the mode does where
    it rounds) fails it; IEEE fp32 products pass it."""
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: real(x.bfloat16().float(), w, b))
    before = torch.backends.mkldnn.matmul.fp32_precision
    assert models._probe_mode_exact() is False
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: (x.double() @ w.double().T).float())
    assert models._probe_mode_exact() is True
    assert torch.backends.mkldnn.matmul.fp32_precision == before  # the probe restores it


def test_scope_nests_and_restores_the_users_setting():
    if not models.bf16_mode_is_exact():
        pytest.skip("the mode stays off on this CPU (it would round operands to bf16)")
    old = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        with models.bf16_matmuls():
            assert _bf16_products()
            with models.bf16_matmuls():
                assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
            assert _bf16_products()
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = old


def test_head_statistics_take_the_mode(tiny, monkeypatch):
    """The engine's fused head (capability.head_stats) runs with bf16 products for a mixed
    model and without them for an fp32 one."""
    from icqs_fast import ops
    from icqs_fast.engine import capability

    seen = []
    real = ops.linear_token_stats

    def spy(*a, **k):
        seen.append(_bf16_products())
        return real(*a, **k)

    monkeypatch.setattr(ops, "linear_token_stats", spy)
    fp32, mixed, _ = tiny
    for m in (mixed, fp32):
        plan = capability.model_plan(m)
        h = torch.randn(3, m.config.hidden_size)
        plan.head_stats(h, torch.tensor([1, 2, 3]))
    assert seen == [models.bf16_mode_is_exact(), False]


def test_avx2_only_cpu_keeps_float32(monkeypatch, tiny_llama_dir):
    monkeypatch.delenv(models.CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr(models, "cpu_bf16_support",
                        lambda: (False, "no native bf16 dot product (neither avx512_bf16 nor AMX)"))
    c = models.choose_dtype("auto", "cpu")
    assert c.dtype == torch.float32 and not c.mixed and c.name == "float32"
    model, _ = models.load_model(tiny_llama_dir(layers=2), device="cpu")
    assert not models.is_bf16_mixed(model) and not model._forward_pre_hooks


def _echo(model, tok, prompts):
    from icqs_fast.serve.logprobs import prompt_logprobs

    with torch.no_grad():
        return [torch.tensor(r.token_logprobs)
                for r in prompt_logprobs(model, prompts, pad_id=tok.pad_token_id)]


def test_echo_logprobs_alone_equal_inside_a_mixed_request(tiny):
    """The server's echo path: a passage alone and inside a request beside prompts of other
    lengths, two of them sharing its start (so it runs as a suffix of the prefix bank)."""
    _, mixed, tok = tiny
    ids = tok(PROMPT * 3)["input_ids"]
    other = tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    alone = _echo(mixed, tok, [ids])[0]
    inside = _echo(mixed, tok, [other[:5], ids[:9] + other[:7], ids, other, ids[:20]])[2]
    assert (alone - inside).abs().max() <= 1e-4


def test_engine_scores_do_not_depend_on_batch_neighbours(tiny):
    from icqs_fast.engine.scorer import ICQSScorer

    _, mixed, tok = tiny
    opts = dict(num_ratios=2, demos_per_set=1, sets_per_ratio=2, seed=0)
    resp = [(PROMPT, " positive"), ("Review: bad\nSentiment:", " negative and long " * 3),
            ("Q?", " A")]
    alone = list(ICQSScorer(mixed, tok, GOOD, BAD, **opts).score(resp[:1]))[0]
    batch = list(ICQSScorer(mixed, tok, GOOD, BAD, **opts).score(resp))[0]
    assert (alone.loglik.double() - batch.loglik.double()).abs().max() <= 1e-4
    assert abs(alone.score - batch.score) <= 1e-5


def test_lm_eval_backend_does_not_depend_on_batch_neighbours(tiny):
    from lm_eval.api.instance import Instance

    from icqs_fast.compat.lm_eval import ICQSFastLM

    _, mixed, tok = tiny
    lm = ICQSFastLM(model=mixed, tokenizer=tok)
    reqs = [(PROMPT, " positive"), (PROMPT, " negative, without any doubt"),
            ("Review: bad\nSentiment:", " negative"), ("x", " y")]
    inst = [Instance("loglikelihood", {}, a, i) for i, a in enumerate(reqs)]
    alone = lm.loglikelihood(inst[:1], disable_tqdm=True)[0][0]
    batch = lm.loglikelihood(inst, disable_tqdm=True)[0][0]
    assert abs(alone - batch) <= 1e-4


def test_probe_of_the_mixed_mode():
    from icqs_fast.benchmarks import roofline

    count = roofline.FlopCount()
    count.linear_rows[(64, 96)] = [8, 8]
    old = torch.backends.mkldnn.matmul.fp32_precision
    out = roofline.matmul_probe(count, "bf16-mixed", seconds=0.01)
    assert out["limit_gflops"] > 0 and out["probe_rows"] == 8
    assert torch.backends.mkldnn.matmul.fp32_precision == old


def test_decoder_linears_take_the_invariant_product(tiny_llama_dir):
    """Every dtype on the CPU: each decoder linear layer multiplies through ops.linear with its
    weight packed once (the head not: it goes through the head statistics), and the engine's
    plain forward gives a prompt the same bits alone and beside a longer, padded one."""
    from icqs_fast.engine.batching import plain_hidden
    from icqs_fast.engine.capability import model_plan

    d = tiny_llama_dir(layers=2)
    for dtype in ("float32", "bf16-mixed", "bf16-products", "bfloat16"):
        model, tok = models.load_model(d, dtype=dtype, device="cpu")
        lins = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        assert lins and all(invariant_linears.uses_packed_weights(m) for m in lins), dtype
        assert not invariant_linears.uses_packed_weights(model.get_output_embeddings())
        long_ids, short = tok(PROMPT)["input_ids"], tok("Sentiment:")["input_ids"]
        plan = model_plan(model)
        both = plain_hidden(model.model, [long_ids, short], 0, torch.device("cpu"),
                            layers=plan.layers)
        one = plain_hidden(model.model, [short], 0, torch.device("cpu"), layers=plan.layers)
        assert torch.equal(both[1, :len(short)], one[0]), dtype


def test_switched_layers_hold_their_weight_once(tiny_llama_dir):
    """At every CPU dtype a switched decoder layer keeps only its packed weight (no weight
    parameter of its own: the packing holds it exactly) until something asks for the weight;
    then it holds an equal one again, its packed product unchanged. The state dict carries the
    weights the dtype computes with, and loads into a plain model."""
    from transformers import AutoModelForCausalLM

    d = tiny_llama_dir(layers=2)
    plain_model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    plain, n_plain = plain_model.state_dict(), sum(p.numel() for p in plain_model.parameters())
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    for dtype in ("float32", "bf16-mixed", "bf16-products", "bfloat16"):
        model, _ = models.load_model(d, dtype=dtype, device="cpu")
        lins = {n: m for n, m in model.named_modules() if ".layers." in n
                and isinstance(m, torch.nn.Linear)}
        assert lins and all("weight" not in m._parameters for m in lins.values()), dtype
        assert invariant_linears.parameter_count(model) == n_plain, dtype
        with torch.no_grad():
            before = model(ids).logits
        sd = model.state_dict()
        for n in lins:
            want = plain[n + ".weight"]
            want = want if dtype == "float32" else want.bfloat16()
            got = sd[n + ".weight"]
            assert torch.equal(got.to(want.dtype), want) and got.dtype == next(
                model.parameters()).dtype, (dtype, n)
        name, lin = next(iter(lins.items()))
        w = lin.weight  # asked for: held again, equal, the packed copy still current
        assert "weight" in lin._parameters and invariant_linears.uses_packed_weights(lin), dtype
        assert torch.equal(w, sd[name + ".weight"])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before), dtype
        fresh = AutoModelForCausalLM.from_pretrained(d, torch_dtype=sd[name + ".weight"].dtype)
        fresh.load_state_dict(sd)  # strict: every key there


def test_packed_weights_step_aside(tiny_llama_dir):
    """With autograd, or once the weight changed, a switched layer computes its own product;
    otherwise ops.linear's, within fp32 rounding of it."""
    model, tok = models.load_model(tiny_llama_dir(layers=2), dtype="bf16-mixed", device="cpu")
    lin = model.model.layers[0].mlp.up_proj
    assert invariant_linears.uses_packed_weights(lin)
    x = torch.randn(2, 5, lin.in_features)
    with torch.no_grad():
        ref = x.double() @ lin.weight.double().T
        assert (lin(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        lin.weight.mul_(2.0)  # in place: the packed copy is stale now
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    xg = torch.randn(3, lin.in_features, requires_grad=True)
    lin(xg).sum().backward()
    assert xg.grad is not None
