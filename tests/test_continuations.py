"""score_continuations against a plain full forward of each whole sequence (independent code:
one unpadded model call per request, log_softmax of the model's own logits)."""

from __future__ import annotations

import pytest
import torch

from icqs_fast.engine.continuations import _bank_chunks, score_continuations

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny(kind: str, vocab: int = 97):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, vocab_size=vocab,
                          max_position_embeddings=256)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, n_positions=256)
        model = GPT2LMHeadModel(cfg)
    return model.eval()


def _plain(model, ctx, cont):
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    lp = logp[pos, torch.tensor(cont)]
    greedy = bool((logp[pos].argmax(-1) == torch.tensor(cont)).all())
    return float(lp.sum()), greedy, lp


def _requests(gen: torch.Generator, vocab: int = 97):
    def ids(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    shared, question = ids(30), ids(7)
    reqs = [
        (shared + question, ids(1)),            # options of one question: same context
        (shared + question, ids(4)),
        (shared + question, ids(2)),
        (shared + ids(5), ids(3)),              # same few-shot prefix, another question
        (shared[:10], ids(6)),                  # a context that is a prefix of the others
        (ids(1), ids(3)),                       # a one-token context: nothing to store
        (ids(1), ids(1)),
        (ids(12), ids(2)),                      # shares nothing
    ]
    return reqs


@pytest.mark.parametrize("kind,cascade", [("llama", None),
                                          pytest.param("llama", False, marks=pytest.mark.slow),
                                          pytest.param("gpt2", None, marks=pytest.mark.slow)])
def test_equals_plain_forward(kind, cascade):
    model = _tiny(kind)
    reqs = _requests(torch.Generator().manual_seed(1))
    # A tiny bank budget forces several chunks; a tiny token budget several forwards per chunk.
    for max_bank in (None, 16):
        out = score_continuations(model, reqs, backend="torch", cascade=cascade, token_budget=12,
                                  max_bank_tokens=max_bank, return_token_stats=True)
        assert len(out) == len(reqs)
        for (ctx, cont), res in zip(reqs, out, strict=True):
            ll, greedy, lp = _plain(model, ctx, cont)
            assert res.n_tokens == len(cont)
            assert abs(res.loglik - ll) <= 1e-4, (ctx, cont, res.loglik, ll)
            assert res.token_logprobs == pytest.approx(lp.tolist(), abs=1e-4)
            assert res.is_greedy == greedy
            assert res.stats.logprob.shape == (len(cont),)


@pytest.mark.slow
def test_greedy_continuation_is_flagged():
    """The model's own greedy tokens are flagged is_greedy; one changed token is not."""
    model = _tiny("llama")
    ctx = [5, 17, 3, 44]
    ids = torch.tensor([ctx])
    greedy = []
    with torch.no_grad():
        for _ in range(3):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            greedy.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    wrong = greedy[:2] + [(greedy[2] + 1) % 97]
    a, b = score_continuations(model, [(ctx, greedy), (ctx, wrong)], backend="torch")
    assert a.is_greedy and not b.is_greedy


def test_shared_prefix_computed_once():
    """Eight options of one 40-token context: the bank's forwards run the context once (the
    capability check's probe, once per model, runs before and is not counted)."""
    from icqs_fast.engine import batching
    from icqs_fast.engine.capability import model_plan

    model = _tiny("llama")
    model_plan(model)
    ctx = list(range(1, 41))
    calls = []

    orig = batching.PrefixBank.add

    def add(self, prefixes):
        out = orig(self, prefixes)
        calls.append(self.forward_tokens)
        return out

    batching.PrefixBank.add = add
    try:
        score_continuations(model, [(ctx, [i + 50]) for i in range(8)], backend="torch")
    finally:
        batching.PrefixBank.add = orig
    assert calls == [39]


def test_bank_chunks_keep_prefixes_whole():
    rows = [(0, (1, 2), [3]), (1, (1, 2), [4]), (2, (1, 3, 4), [5]), (3, (2,), [6])]
    chunks = _bank_chunks(rows, 3)
    assert [[r[0] for r in c] for c in chunks] == [[0, 1], [2], [3]]
    assert [[r[0] for r in c] for c in _bank_chunks(rows, 100)] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("bad,msg", [([([], [1])], "empty context"),
                                     ([([1], [])], "empty continuation"),
                                     ([(1, 2, 3)], "expected a")])
def test_bad_requests(bad, msg):
    with pytest.raises(ValueError, match=msg):
        score_continuations(_tiny("llama"), bad)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "mamba", "prophetnet"])
@pytest.mark.slow
def test_every_path_matches_a_plain_forward(kind):
    """The continuation scorer (the lm-eval model's and the server's engine) follows the
    capability check's plan: a 16-token window on every layer (Mistral) or one layer with
    softcaps (Gemma 2) through the bank, Mamba's recurrent layers and ProphetNet's own logits on
    the plain path; contexts of 40-60 tokens, longer than the window. Each request equals a
    plain forward of its whole sequence."""
    from model_matrix import tiny_model

    from icqs_fast.engine.capability import model_plan

    model = tiny_model(kind, 300, window=16)
    path = model_plan(model).path
    assert path == {"mistral": "cascade", "gemma2": "cascade"}.get(kind, "plain")
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 300, (40,), generator=g).tolist()
    reqs = [(shared + torch.randint(3, 300, (n,), generator=g).tolist(),
             torch.randint(3, 300, (m,), generator=g).tolist())
            for n, m in ((5, 3), (20, 1), (1, 4))]
    got = score_continuations(model, reqs, backend="torch")
    for r, (ctx, cont) in zip(got, reqs, strict=True):
        ll, greedy, _ = _plain(model, ctx, cont)
        assert r.loglik == pytest.approx(ll, abs=1e-4)
        assert r.is_greedy == greedy
