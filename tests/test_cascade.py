"""Cascade attention (shared prefix states, no per-row KV copy) against the per-row KV-copy path
of ``suffix_hidden``: same hidden states for unsorted entries, irregular entry groups, prefixes
of different lengths, Llama (GQA, RoPE) and GPT-2 (absolute positions)."""

import pytest
import torch

from icqs_fast.engine.batching import PrefixBank, forward_cost_tokens, suffix_hidden
from icqs_fast.engine.capability import model_plan


def _model(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                          max_position_embeddings=512)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg).eval()
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=512)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["uniform", pytest.param("irregular", marks=pytest.mark.slow)])
def test_cascade_matches_kv_copy(kind, layout):
    model = _model(kind)
    assert model_plan(model).path == "cascade"
    g = torch.Generator().manual_seed(1)
    bank = PrefixBank(model, 0, 10_000)
    prefixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (17, 9, 30)]
    bank.add(prefixes)
    if layout == "uniform":  # every entry twice, rows not in entry order
        entries = [2, 0, 1, 0, 1, 2]
    else:
        entries = [1, 0, 0, 2, 0, 1, 0]
    suffixes = [torch.randint(1, 300, (int(n),), generator=g).tolist()
                for n in torch.randint(1, 12, (len(entries),), generator=g)]
    h_ref, m_ref = suffix_hidden(model, bank, entries, suffixes, 0, cascade=False)
    h, m = suffix_hidden(model, bank, entries, suffixes, 0, cascade=True)
    assert torch.equal(m, m_ref)
    torch.testing.assert_close(h[m], h_ref[m], atol=1e-5, rtol=1e-5)
    # The model's attention implementation is restored.
    assert model.config._attn_implementation == ("sdpa" if kind == "llama" else "eager")


def _assert_bank_equals_plain_forwards(model, bank, prefixes):
    """Entry e's stored keys/values equal a plain, unpadded forward of prefixes[e]; the slots
    past its length are zero (masked in attention, and finite)."""
    from transformers import DynamicCache

    from icqs_fast.engine.batching import _layer_kv, decoder_body

    for e, p in enumerate(prefixes):
        with torch.no_grad():
            out = decoder_body(model)(input_ids=torch.tensor([p]), use_cache=True,
                                      past_key_values=DynamicCache())
        for li, (k, v) in enumerate(_layer_kv(out.past_key_values)):
            torch.testing.assert_close(bank.keys[li][e, :, :len(p)], k[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(bank.values[li][e, :, :len(p)], v[0], atol=1e-5, rtol=1e-5)
            assert not bank.keys[li][e, :, len(p):].any()
            assert not bank.values[li][e, :, len(p):].any()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_bank_states_match_a_plain_forward(kind):
    """Every entry's stored keys/values equal those of a plain, unpadded forward of that prefix
    (written straight into the bank, in chunks; unused slots zero); adding entries later
    (longer and shorter than the stored ones) keeps the earlier entries intact."""
    model = _model(kind)
    g = torch.Generator().manual_seed(2)
    prefixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (17, 9, 30, 5, 41, 3)]
    bank = PrefixBank(model, 0, 40)  # a 40-token budget forces several chunks
    assert bank.add(prefixes[:3]) == [0, 1, 2]
    assert bank.add(prefixes[3:]) == [3, 4, 5]
    assert bank.lengths == [17, 9, 30, 5, 41, 3]
    _assert_bank_equals_plain_forwards(model, bank, prefixes)


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_shared_tokens_are_computed_once(kind, monkeypatch):
    """Prefixes that share leading tokens (all of them, nested groups, one a prefix of another,
    two identical) are computed along their token trie: each shared token runs once, and every
    entry still equals a plain forward of its own prefix."""
    from icqs_fast.engine import batching
    from icqs_fast.engine.batching import _trie_edges

    monkeypatch.setattr(batching, "FORWARD_COST_TOKENS", (0, 0))  # split off every shared run
    model = _model(kind)
    g = torch.Generator().manual_seed(3)

    def rnd(n):
        return torch.randint(1, 300, (n,), generator=g).tolist()

    head, a, b = rnd(6), rnd(5), rnd(4)
    prefixes = [head + a + rnd(7), head + a + rnd(3), head + a, head + b + rnd(9), head + rnd(2),
                head + b + rnd(9), head + a + [7, 8]]
    prefixes.append(list(prefixes[3]))  # identical to entry 3
    # Trie tokens: head 6, a 5, three tails under a (7, 3, 2), b 4, two tails (9, 9), tail 2.
    assert sum(e - d for level in _trie_edges(prefixes) for d, e, _ in level) == 47
    # With a forward costing 12 tokens, shared runs saving less are recomputed per branch: b
    # (4 tokens under 3 sequences, two of them identical: saves 8) runs twice, a (5 tokens x 4
    # sequences: saves 15) and head stay shared.
    assert sum(e - d for level in _trie_edges(prefixes, 12) for d, e, _ in level) == 47 + 4
    bank = PrefixBank(model, 0, 10_000)
    bank.add(prefixes[:1])  # a later add copies the earlier entries
    computed = bank.forward_tokens
    assert bank.add(prefixes[1:]) == list(range(1, len(prefixes)))
    # Padding adds little: a level's edges run sorted by length, near-equal ones together.
    assert bank.forward_tokens - computed <= 47 + 10
    assert bank.forward_tokens - computed < sum(map(len, prefixes[1:])) // 2
    _assert_bank_equals_plain_forwards(model, bank, prefixes)


def _force_fused(monkeypatch):
    """Run cascade attention through the fused Triton kernel on CPU (the interpreter)."""
    from icqs_fast import backends
    from icqs_fast.engine import cascade

    if not backends.triton_interpreting():
        pytest.skip("the fused path needs CUDA or TRITON_INTERPRET=1")
    # "auto" never picks the interpreter: name the triton backend of ops.attention_lse.
    monkeypatch.setattr(cascade, "_kernel_backend", lambda *a, **k: "triton")


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["uniform", pytest.param("irregular", marks=pytest.mark.slow)])
def test_fused_cascade_matches_current_path(kind, layout, monkeypatch):
    """The CUDA path (fused Triton attention with LSE, run in the interpreter) gives the same
    hidden states as the CPU path (``_attn_lse``) and the per-row KV-copy path: GQA (Llama) and
    MHA (GPT-2), prefixes of different lengths (padded slots masked), uniform and irregular
    entry groups."""
    model = _model(kind)
    g = torch.Generator().manual_seed(4)
    bank = PrefixBank(model, 0, 10_000)
    bank.add([torch.randint(1, 300, (n,), generator=g).tolist() for n in (17, 9, 30)])
    entries = [2, 0, 1, 0, 1, 2] if layout == "uniform" else [1, 0, 0, 2, 0, 1, 0]
    suffixes = [torch.randint(1, 300, (int(n),), generator=g).tolist()
                for n in torch.randint(1, 12, (len(entries),), generator=g)]
    h_copy, m_copy = suffix_hidden(model, bank, entries, suffixes, 0, cascade=False)
    h_cpu, m_cpu = suffix_hidden(model, bank, entries, suffixes, 0, cascade=True)
    _force_fused(monkeypatch)
    h, m = suffix_hidden(model, bank, entries, suffixes, 0, cascade=True)
    assert torch.equal(m, m_cpu) and torch.equal(m, m_copy)
    torch.testing.assert_close(h[m], h_cpu[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[m], h_copy[m], atol=1e-5, rtol=1e-5)


def test_fused_attn_lse_matches_attn_lse():
    """``ops.attention_lse`` on the triton backend (what cascade attention runs on CUDA)
    against ``attn_lse`` (the CPU path) on the two calls cascade attention makes: grouped
    prefix queries against padded prefixes (key mask vs additive mask, different lengths per
    entry) and causal GQA suffix attention (vs the grouped causal mask); outputs and
    log-sum-exps, fp32."""
    from icqs_fast import backends, ops
    from icqs_fast.engine.cascade import attn_lse, grouped_causal_allow

    def _fused_attn_lse(q, k, v, scale, causal=False, key_ok=None):
        return ops.attention_lse(q, k, v, scale=scale, causal=causal, attention_mask=key_ok,
                                 backend="triton")

    if not backends.triton_interpreting():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(5)
    # prefix part: G=3 entries of lengths 21, 6, 33 (P_max 33), Hk=2, 2 rows x group 2 x S 5
    lens = torch.tensor([21, 6, 33])
    q = torch.randn(3, 2, 20, 16, generator=g)
    k = torch.randn(3, 2, 33, 16, generator=g) * 2
    v = torch.randn(3, 2, 33, 16, generator=g)
    key_ok = torch.arange(33)[None, :] < lens[:, None]
    o_ref, l_ref = attn_lse(q, k, v, key_ok[:, None, None, :], 0.25)
    o, lse = _fused_attn_lse(q, k, v, 0.25, key_ok=key_ok)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, l_ref, atol=1e-5, rtol=1e-5)
    # suffix part: R=3 rows, Hq=4 over Hk=2, S=9, causal
    r, hq, hk, s, d = 3, 4, 2, 9, 16
    q = torch.randn(r, hq, s, d, generator=g)
    k = torch.randn(r, hk, s, d, generator=g)
    v = torch.randn(r, hk, s, d, generator=g)
    o_ref, l_ref = attn_lse(q.reshape(r, hk, 2 * s, d), k, v,
                            grouped_causal_allow(2, s, q.device), 0.3)
    o, lse = _fused_attn_lse(q, k, v, 0.3, causal=True)
    torch.testing.assert_close(o, o_ref.reshape(r, hq, s, d), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, l_ref.reshape(r, hq, s), atol=1e-5, rtol=1e-5)


def test_a_forward_costs_fewer_tokens_for_more_weights_a_layer():
    """``forward_cost_tokens``: the CPU's table value for the embedded model's layer size (576,
    1536), fewer tokens for bigger layers down to the floor, the table's value for smaller ones
    and without the sizes; the GPU's value whatever the model."""
    from transformers import AutoConfig

    from icqs_fast.engine import batching

    gpu, cpu = batching.FORWARD_COST_TOKENS

    class Stub(torch.nn.Module):
        def __init__(self, **sizes):
            super().__init__()
            self.config = AutoConfig.for_model("llama", **sizes)

    dev = torch.device("cpu")
    assert forward_cost_tokens(Stub(hidden_size=576, intermediate_size=1536), dev) == cpu
    mid = forward_cost_tokens(Stub(hidden_size=640, intermediate_size=2048), dev)
    assert batching.FORWARD_COST_FLOOR_CPU < mid < cpu
    big = Stub(hidden_size=2048, intermediate_size=8192)
    assert forward_cost_tokens(big, dev) == batching.FORWARD_COST_FLOOR_CPU
    assert forward_cost_tokens(Stub(hidden_size=64, intermediate_size=128), dev) == cpu
    assert forward_cost_tokens(torch.nn.Linear(2, 2), dev) == cpu
    assert forward_cost_tokens(big, torch.device("meta")) == gpu
