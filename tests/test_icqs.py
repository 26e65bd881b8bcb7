"""ICQS engine vs the naive reference (one full forward + log_softmax per prompt)."""

import pytest
import torch
from _helpers import DEVICE, assert_same_scores

from icqs_fast import ICQSResult, ICQSScorer
from icqs_fast.engine.prompts import Template
from icqs_fast.engine.reference import icqs_naive
from icqs_fast.models import embedded_model_dir, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Demonstrations of quite different lengths, so prefixes differ in length across contexts.
GOOD = [
    ("the movie was great", "positive"),
    ("I loved it", "positive"),
    ("superb acting and a moving, beautifully shot story about two brothers", "positive"),
    ("dull", "negative"),
    ("a tedious, overlong and frankly insulting mess", "negative"),
]
BAD = [
    ("terrible film", "positive"),
    ("boring", "positive"),
    ("a joyous, generous celebration of life that left the whole audience in tears", "negative"),
    ("wonderful", "negative"),
    ("I would watch it again tomorrow", "negative"),
]
RESPONSES = [
    ("a wonderful time", "positive"),
    ("awful", "negative"),
    # Longer response than some of the prefixes.
    ("what was it", "a long and pointless exercise in tedium, truly the worst film of the year, "
     "with wooden acting and a plot that goes nowhere at all, negative"),
    ("not bad at all", "positive"),
]
ATOL = 1e-4
# The reference takes log_softmax in float64: fp32 over a 49k vocabulary drifts ~5e-6 per token.
F64 = torch.float64


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def _tiny(kind: str, attn: str, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, vocab_size=vocab,
                          attn_implementation=attn)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=256,
                         bos_token_id=0, eos_token_id=0, attn_implementation=attn)
        model = GPT2LMHeadModel(cfg)
    return model.to(DEVICE).eval()


def _compare(a: list[ICQSResult], b: list[ICQSResult], atol: float = ATOL) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.index == y.index == i
        assert x.loglik.dtype == torch.float32 and x.loglik.shape == y.loglik.shape
        torch.testing.assert_close(x.loglik, y.loglik, atol=atol, rtol=0)
        # Same log-likelihoods: the same scores (identical argmax, the posterior mean to rounding).
        assert_same_scores(x, y)
        assert x.ratios == y.ratios
        assert x.n_response_tokens == y.n_response_tokens
        assert torch.equal(x.n_prompt_tokens, y.n_prompt_tokens)
        assert torch.equal(x.n_dropped_demos, y.n_dropped_demos)


def _check_scores(r: ICQSResult) -> None:
    # Score definitions, recomputed directly from the log-likelihoods.
    ll = r.loglik.double()
    if r.score_kind == "argmax":
        assert r.score == r.ratios[int(ll.mean(1).argmax())]
        assert r.score_per_set == [r.ratios[int(k)] for k in ll.argmax(0)]
    else:  # the default: the posterior mean of the ratio under a uniform prior
        rat = torch.tensor(r.ratios, dtype=torch.float64)
        q = torch.exp(ll.mean(1) - ll.mean(1).max())
        assert r.score == pytest.approx(float((q * rat).sum() / q.sum()), abs=1e-9)
        qs = torch.exp(ll - ll.max(0).values)
        assert r.score_per_set == pytest.approx(((qs * rat[:, None]).sum(0) / qs.sum(0)).tolist(),
                                                abs=1e-9)


KW = dict(num_ratios=3, demos_per_set=2, sets_per_ratio=2, seed=1)


# Llama with sdpa in the fast tier; the other three in the slow group.
@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_tiny_engine_matches_naive(tokenizer, kind, attn):
    model = _tiny(kind, attn, len(tokenizer))
    # A small budget splits a response's contexts over several forwards.
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, token_budget=200, backend="torch", **KW)
    got = list(scorer.score(RESPONSES))
    ref = icqs_naive(model, tokenizer, GOOD, BAD, RESPONSES, compute_dtype=F64, **KW)
    _compare(got, ref)
    for r in got:
        _check_scores(r)
    lens = scorer.prefix_bank.lengths
    assert len(set(lens)) > 1  # prefixes of different lengths
    assert got[2].n_response_tokens > min(lens)  # a response longer than some prefixes


@pytest.mark.slow
def test_token_stats_match_reference(tokenizer):
    model = _tiny("llama", "sdpa", len(tokenizer))
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, return_token_stats=True, **KW)
    got = list(scorer.score(RESPONSES[:2]))
    ref = icqs_naive(model, tokenizer, GOOD, BAD, RESPONSES[:2], return_token_stats=True,
                     compute_dtype=F64, **KW)
    for x, y in zip(got, ref, strict=True):
        t = x.n_response_tokens
        assert x.token_stats.logprob.shape == (3, 2, t)
        for name, v in x.token_stats.as_dict().items():
            w = getattr(y.token_stats, name)
            if v.is_floating_point():
                torch.testing.assert_close(v, w, atol=2e-4, rtol=1e-4, msg=name)
            else:
                assert torch.equal(v, w), name
        torch.testing.assert_close(x.token_stats.logprob.double().sum(-1).float(), x.loglik,
                                   atol=1e-5, rtol=0)


@pytest.mark.slow
def test_prefix_cache_not_mutated_and_batching_invariant(tokenizer):
    model = _tiny("llama", "sdpa", len(tokenizer))
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, token_budget=100_000, **KW)
    bank = scorer.prefix_bank
    before_k = [k.clone() for k in bank.keys]
    before_v = [v.clone() for v in bank.values]
    ids_before = [id(k) for k in bank.keys]
    together = list(scorer.score(RESPONSES))  # all responses in one forward
    assert [id(k) for k in bank.keys] == ids_before
    for a, b in zip(before_k + before_v, bank.keys + bank.values, strict=True):
        assert torch.equal(a, b)
    one_by_one = [scorer.score_one(x, y) for x, y in RESPONSES]
    for a, b in zip(together, one_by_one, strict=True):
        torch.testing.assert_close(a.loglik, b.loglik, atol=1e-5, rtol=0)
        assert_same_scores(a, b)
    # Still unchanged after more scoring.
    for a, b in zip(before_k + before_v, bank.keys + bank.values, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_streaming_is_lazy(tokenizer):
    model = _tiny("llama", "sdpa", len(tokenizer))
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, token_budget=300, **KW)
    pulled = []

    def gen():
        for i in range(8):
            pulled.append(i)
            yield {"x": f"sentence number {i}", "y": "positive" if i % 2 else "negative"}

    out = scorer.score(gen())
    first = next(out)
    assert first.index == 0
    assert len(pulled) < 8  # the first result came before the input was exhausted
    rest = list(out)
    assert [r.index for r in rest] == list(range(1, 8))
    assert len(pulled) == 8


@pytest.mark.slow
def test_drop_oldest_demos(tokenizer):
    model = _tiny("gpt2", "sdpa", len(tokenizer))
    # Response 2 with one demonstration takes 61 whole-text tokens ("\n\n" before the query is
    # two tokens there), so 64 fits it only after dropping.
    kw = dict(KW, max_length=64)
    with pytest.raises(ValueError, match=r"response 2: prompt of \d+ tokens .* max length 64"):
        list(ICQSScorer(model, tokenizer, GOOD, BAD, **kw).score(RESPONSES[:3]))
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, drop_oldest_demos=True, **kw)
    got = list(scorer.score(RESPONSES[:3]))
    ref = icqs_naive(model, tokenizer, GOOD, BAD, RESPONSES[:3], drop_oldest_demos=True,
                     compute_dtype=F64, **kw)
    _compare(got, ref)
    assert int(got[2].n_dropped_demos.sum()) > 0
    assert int((got[2].n_prompt_tokens + got[2].n_response_tokens).max()) <= 64
    # A response longer than the max length by itself: said so (no demonstration count helps).
    with pytest.raises(ValueError, match=r"the query and response alone are \d+ tokens, not "
                       r"less than the model's max length 30"):
        list(ICQSScorer(model, tokenizer, GOOD, BAD, drop_oldest_demos=True,
                        **dict(KW, max_length=30)).score(RESPONSES[2:3]))


@pytest.mark.slow
def test_custom_template_and_bernoulli(tokenizer):
    model = _tiny("llama", "eager", len(tokenizer))
    tpl = Template(demo="Review: {x} => {y}", query="Review: {x} =>", response=" {y}",
                   separator="\n", system="Label each review.\n")
    kw = dict(KW, template=tpl, mixing="bernoulli", replacement=True, seed=5)
    got = list(ICQSScorer(model, tokenizer, GOOD, BAD, **kw).score(RESPONSES[:2]))
    ref = icqs_naive(model, tokenizer, GOOD, BAD, RESPONSES[:2], compute_dtype=F64, **kw)
    _compare(got, ref)
    # The response is tokenised alone: " positive" under this template.
    assert got[0].n_response_tokens == len(tokenizer(" positive", add_special_tokens=False)
                                           ["input_ids"])


@pytest.mark.slow
def test_chat_template_prompts(tokenizer):
    """Template.from_chat_template lays the prompt out exactly as the tokenizer's chat template
    renders the same conversation, and the engine matches the naive method with it."""
    tpl = Template.from_chat_template(tokenizer, system="Label each review.")
    demos = [GOOD[0], BAD[1]]
    x, y = RESPONSES[0]
    msgs = [{"role": "system", "content": "Label each review."}]
    for dx, dy in [*demos, (x, y)]:
        msgs += [{"role": "user", "content": dx}, {"role": "assistant", "content": dy}]
    text = tpl.format_prefix(demos) + tpl.format_query(x) + tpl.format_response(y)
    assert text == tokenizer.apply_chat_template(msgs, tokenize=False)
    # Chat markers are single special tokens in the response part (y + end of turn).
    n_resp = len(tokenizer(tpl.format_response(y), add_special_tokens=False)["input_ids"])
    assert n_resp == len(tokenizer(y, add_special_tokens=False)["input_ids"]) + 2
    model = _tiny("llama", "sdpa", len(tokenizer))
    kw = dict(KW, template=tpl)
    got = list(ICQSScorer(model, tokenizer, GOOD, BAD, **kw).score(RESPONSES[:2]))
    ref = icqs_naive(model, tokenizer, GOOD, BAD, RESPONSES[:2], compute_dtype=F64, **kw)
    _compare(got, ref)
    assert got[0].n_response_tokens == n_resp


def test_chat_template_missing():
    class NoChat:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        Template.from_chat_template(NoChat())


def test_input_errors(tokenizer):
    model = _tiny("llama", "sdpa", len(tokenizer))
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
    with pytest.raises(ValueError, match=r"response 1: field 'y' is empty"):
        list(scorer.score([("a", "b"), ("c", "")]))
    with pytest.raises(TypeError, match=r"response 0: field 'x' must be a str, got int"):
        list(scorer.score([(3, "b")]))
    with pytest.raises(TypeError, match=r"response 2: field 'y' must be a str, got NoneType"):
        list(scorer.score([("a", "b"), {"x": "a", "y": "b"}, {"x": "a", "y": None}]))
    with pytest.raises(ValueError, match=r"response 0: missing field\(s\) \['y'\]"):
        list(scorer.score([{"x": "a"}]))
    with pytest.raises(TypeError, match=r"response 0: expected an \(x, y\) pair"):
        list(scorer.score(["just a string"]))
    with pytest.raises(ValueError, match=r"2 good and 5 bad"):
        ICQSScorer(model, tokenizer, GOOD[:2], BAD, num_ratios=3, demos_per_set=3)
    with pytest.raises(ValueError, match=r"5 good and 1 bad"):
        ICQSScorer(model, tokenizer, GOOD, BAD[:1], num_ratios=3, demos_per_set=3)
    with pytest.raises(TypeError, match="demos_per_sett"):  # misspelt: not silently ignored
        icqs_naive(model, tokenizer, GOOD, BAD, RESPONSES[:1], demos_per_sett=3)
    with pytest.warns(UserWarning, match="training mode"):
        ICQSScorer(model.train(), tokenizer, GOOD, BAD, **KW)
    model.eval()
    ok = ICQSScorer(model, tokenizer, GOOD[:2], BAD, num_ratios=3, demos_per_set=3,
                    sets_per_ratio=1, replacement=True)
    assert ok.score_one("a", "b").loglik.shape == (3, 1)


@pytest.mark.slow
def test_one_forward_per_batch_and_head_only_at_response_tokens(tokenizer, monkeypatch):
    """After the prefix bank is built, all (M+1) L contexts of a response run in one decoder
    forward (two responses in one too, within the token budget), the LM head module never runs,
    and the head's product is taken only at the response tokens (rows = contexts x tokens)."""
    from icqs_fast import ops
    from icqs_fast.engine import scorer as icqs_mod

    model = _tiny("llama", "sdpa", len(tokenizer))
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
    scorer.prefix_bank  # noqa: B018
    calls = {"body": [], "head": 0, "lts_rows": []}
    body = model.base_model
    h1 = body.register_forward_hook(
        lambda mod, args, kw, out: calls["body"].append(kw["input_ids"].shape), with_kwargs=True)
    h2 = model.get_output_embeddings().register_forward_hook(
        lambda *a: calls.__setitem__("head", calls["head"] + 1))
    real = ops.linear_token_stats

    def counting(h, *a, **k):
        calls["lts_rows"].append(h.shape[0])
        return real(h, *a, **k)

    monkeypatch.setattr(icqs_mod.ops, "linear_token_stats", counting)
    try:
        res = list(scorer.score(RESPONSES[:2]))
    finally:
        h1.remove()
        h2.remove()
    n_ctx = scorer.n_contexts
    assert len(calls["body"]) == 1 and calls["body"][0][0] == 2 * n_ctx
    assert calls["head"] == 0
    assert calls["lts_rows"] == [n_ctx * sum(r.n_response_tokens for r in res)]


# --------------------------------------------------------------------------- embedded model


@pytest.fixture(scope="module")
def embedded():
    model, tok = load_model(device=DEVICE, dtype="float32")
    return model, tok


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_embedded_engine_matches_naive(embedded, attn):
    model, tok = embedded
    model.set_attn_implementation(attn)
    try:
        kw = dict(num_ratios=3, demos_per_set=3, sets_per_ratio=2, seed=0)
        resp = RESPONSES[:3] if attn == "sdpa" else RESPONSES[2:3]
        got = list(ICQSScorer(model, tok, GOOD, BAD, **kw).score(resp))
        ref = icqs_naive(model, tok, GOOD, BAD, resp, compute_dtype=F64, **kw)
        _compare(got, ref)
    finally:
        model.set_attn_implementation("sdpa")
