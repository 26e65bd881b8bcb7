"""The tiny-model matrix (tests/model_matrix.py): every causal-LM type transformers maps either
builds from a tiny config (each built, run and scored in tests/test_model_coverage.py) or is
excluded with a reason (and really fails, checked here)."""

import pytest
import torch
from model_matrix import (
    EXCLUDED,
    OVERRIDES,
    attention_features,
    causal_lm_types,
    tiny_config,
    tiny_model,
)

pytestmark = [pytest.mark.matrix, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 49152  # the embedded SmolLM2 tokenizer's vocabulary
TYPES = causal_lm_types()


def test_mapping_is_listed_sorted_and_tables_name_real_types():
    assert TYPES == sorted(set(TYPES)) and len(TYPES) > 100
    assert set(EXCLUDED) <= set(TYPES)
    assert set(OVERRIDES) <= set(TYPES)
    assert not set(EXCLUDED) & set(OVERRIDES)
    assert all(isinstance(r, str) and len(r) > 20 for r in EXCLUDED.values())


@pytest.mark.parametrize("model_type", sorted(EXCLUDED))
def test_excluded_types_really_fail(model_type):
    """Every excluded type still fails to build or to run a text-only forward (the buildable
    ones are each built, run and scored by tests/test_model_coverage.py)."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception):  # noqa: B017 - any failure: the reason says which
        with torch.no_grad():
            tiny_model(model_type, VOCAB)(input_ids=ids)


@pytest.mark.parametrize("model_type", ["llama", "mamba", "gemma3n_text", "hrm_text"])
def test_type_builds_small_and_finite(model_type):
    model = tiny_model(model_type, VOCAB)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 30_000_000
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 12, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "jamba"])
def test_tiny_model_is_deterministic(model_type):
    a, b = tiny_model(model_type, VOCAB, seed=3), tiny_model(model_type, VOCAB, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_config_shrinks_and_keeps_switches():
    cfg = tiny_config("llama", VOCAB)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 4)
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (2, 128, VOCAB)
    assert cfg.max_position_embeddings >= 1024
    q = tiny_config("qwen2", VOCAB, window=8)
    assert q.use_sliding_window is False  # the switch stays off (qwen2 then drops the window)
    assert tiny_config("mistral", VOCAB, window=8).sliding_window == 8
    moe = tiny_config("mixtral", VOCAB)
    assert (moe.num_local_experts, moe.num_experts_per_tok) == (4, 2)


@pytest.mark.parametrize(
    "model_type, kinds",
    [
        ("gemma2", {"sliding_attention", "full_attention"}),
        ("gemma3_text", {"sliding_attention", "full_attention"}),
        ("gpt_oss", {"sliding_attention", "full_attention"}),
        ("qwen3_next", {"linear_attention", "full_attention"}),
        ("llama4_text", {"chunked_attention", "full_attention"}),
    ],
)
def test_both_layer_kinds_and_the_window(model_type, kinds):
    cfg = tiny_config(model_type, VOCAB, window=8)
    f = attention_features(cfg)
    assert set(f["layer_kinds"]) == kinds
    if "linear_attention" not in kinds:
        assert 8 in f["window"].values()


def test_features_name_what_the_modeling_code_does():
    assert attention_features(tiny_config("gpt_oss", VOCAB))["sinks"]
    assert attention_features(tiny_config("deepseek_v3", VOCAB))["mla"]
    assert attention_features(tiny_config("bloom", VOCAB))["alibi"]
    g = attention_features(tiny_config("gemma2", VOCAB))
    assert g["softcaps"] == {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
    assert attention_features(tiny_config("granite", VOCAB))["logit_postprocess"][0] == (
        "logits_scaling"
    )
    assert attention_features(tiny_config("mamba", VOCAB))["recurrent"] == "mamba"
    assert attention_features(tiny_config("llama", VOCAB), tiny_model("llama", VOCAB))[
        "lm_head_plain_linear"
    ]
    assert not attention_features(tiny_config("bert", VOCAB), tiny_model("bert", VOCAB))[
        "lm_head_plain_linear"
    ]
