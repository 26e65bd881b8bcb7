"""A generated matrix of every causal-LM family transformers can build from a tiny random config.

``causal_lm_types()`` lists every model_type of transformers' causal-LM auto mapping;
``tiny_config`` / ``tiny_model`` shrink any of them generically (a table of attribute-name aliases,
per-layer lists cut down to one layer of each kind) plus per-type ``OVERRIDES``; ``EXCLUDED`` names
the types that cannot run a plain ``input_ids`` forward, with the reason; ``attention_features``
says what a tiny config exercises (windows, softcaps, logit scaling, sinks, MLA, recurrent layers).

``python tests/model_matrix.py`` builds every type, runs a forward (batch 2 x 40 tokens), a
right-padded batch, and reports timings and the alone-vs-padded logits difference per type.
"""

from __future__ import annotations

import warnings

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
EXPERTS, TOP_K, MOE_INTERMEDIATE = 4, 2, 32
MAX_POSITIONS = 1024

# attribute-name aliases -> tiny value (applied where the config has the attribute and it is not
# None: None means "feature off" or "derived from the others" and stays so).
ALIASES: dict[int | str, tuple[str, ...]] = {}
_SIZE_TABLE: list[tuple[tuple[str, ...], object]] = [
    (("hidden_size", "n_embd", "d_model", "dim", "embedding_dim", "emb_dim", "embed_dim",
      "hidden_dim", "n_embed", "d_embed", "embedding_size", "word_embed_proj_dim",
      "input_embedding_size", "output_embedding_size", "attention_hidden_size", "lru_width",
      "backbone_hidden_size", "adapter_in_dim", "adapter_input_size", "adapter_out_dim",
      "hidden_size_global"), HIDDEN),
    (("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
      "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
      "num_encoder_attention_heads", "swa_num_attention_heads", "linear_num_heads"), HEADS),
    (("num_key_value_heads", "num_kv_heads", "num_query_groups", "multi_query_group_num",
      "swa_num_key_value_heads", "kv_n_heads"), KV_HEADS),
    (("head_dim", "d_head", "dim_head", "attention_head_dim", "attention_head_size", "kv_channels",
      "swa_head_dim", "linear_head_dim", "qk_head_dim", "v_head_dim", "index_head_dim",
      "query_pre_attn_scalar"), HEAD_DIM),
    (("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff",
      "dff", "dim_ff", "ffn_hidden_size", "feed_forward_size", "d_inner", "intermediate_size_mlp",
      "dense_intermediate_size"), INTERMEDIATE),
    # MLA (deepseek-style): q/k = nope + rope dims, v its own
    (("kv_lora_rank", "q_lora_rank", "o_lora_rank"), 32),
    (("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    (("rotary_dim",), 8),
    # MoE
    (("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), EXPERTS),
    (("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "moe_top_k",
      "top_k_experts"), TOP_K),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
      "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size",
      "shared_experts_intermediate_size"), MOE_INTERMEDIATE),
    (("n_group", "num_expert_group", "topk_group"), 1),
    (("index_n_heads",), 2),
    # state-space / linear-attention dims (hidden 64, expand 2 -> inner 128 = 8 heads x 16)
    (("mamba_d_state", "state_size", "ssm_state_size"), 16),
    (("mamba_n_heads", "mamba_num_heads"), 8),
    (("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    (("mamba_n_groups", "mamba_ngroups", "n_groups"), 1),
    (("linear_num_key_heads",), KV_HEADS),
    (("linear_num_value_heads",), HEADS),
    (("linear_key_head_dim", "linear_value_head_dim"), HEAD_DIM),
    (("hidden_size_per_layer_input",), 16),
    (("mamba_d_ssm",), 128),
]
SIZES: dict[str, object] = {name: value for names, value in _SIZE_TABLE for name in names}
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
              "num_decoder_layers", "num_blocks")
ENCODER_LAYER_KEYS = ("encoder_layers", "num_encoder_layers")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                 "max_sequence_length", "context_length", "max_target_positions")
WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "sliding_window_size",
               "attention_window_size", "local_attention_window_len", "local_attention")
FILL_IF_NONE = ("head_dim", "num_key_value_heads")
FILL_IF_NONE_MOE = ("num_experts_per_tok", "moe_intermediate_size")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
DENSE_PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers")
# lists of layer indices (not per-layer values): remapped onto the kept layers
INDEX_LISTS = ("full_attn_idxs", "moe_layers", "hybrid_layer_ids", "cross_attention_layers",
               "mlp_only_layers", "attn_layer_indices")
MAX_TINY_LAYERS = 6

# Per-type config overrides, applied last (after the generic shrink), only where it fails.
# Keys: config kwargs; "_init": kwargs the *default* config needs to construct at all;
# a sub-config name (e.g. "text_config"): kwargs merged into that sub-config.
OVERRIDES: dict[str, dict] = {
    # hybrids: the generic 2 layers would all be recurrent; make one of each kind
    "bamba": {"attn_layer_indices": [1]},  # default None = no attention layer at all
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},  # linear = mamba2
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1,  # layer 0 mamba, 1 attention
              "expert_layer_period": 2, "expert_layer_offset": 1},  # layer 0 dense, 1 MoE
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"],  # default None crashes the model
                 "num_dense_layers": 1},
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1,
             "n_output_layers": 1, "n_recurrent_loops": 2,  # input / looped / output blocks
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # zamba: one shared transformer block reused by >= 2 hybrid layers (the tied-weights regex
    # wants a second user); its attention runs on concat(hidden, embeddings) = 2 x hidden
    "zamba": {"num_hidden_layers": 4,
              "layers_block_type": ["linear_attention", "hybrid"] * 2,
              "attn_layer_period": 2, "attn_layer_offset": 1,
              "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS,
              "mamba_dt_rank": 8, "n_mamba_heads": 2},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS,
               "n_mamba_heads": 8, "mamba_headdim": 16, "adapter_rank": 8},
    # mamba2: hidden * expand (128) must equal num_heads * head_dim
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    # default expert counts are None (the default config cannot build); dense layer 0, MoE 1
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1,
              "first_k_dense_replace": 1},
    # rope_parameters default {} but the model reads rope_parameters[layer_type]
    "cohere_compass_text": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not define
    # (hub configs carry it as an extra key)
    # and its forward clamps qkv with clip_qkv, which must not be None (dbrx-instruct: 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the mLSTM cache rounds qk_dim = hidden * qk_dim_factor (0.5) up to a multiple of 64, the
    # layer does not: hidden 128 keeps both at 64
    "xlstm": {"hidden_size": 2 * HIDDEN, "embedding_dim": 2 * HIDDEN},
    # axial position factors must multiply to max positions and sum to hidden
    "reformer": {"axial_pos_shape": [32, 32], "axial_pos_embds_dim": [32, 32]},
    # its SWA layers are MLA too: head_dim must equal qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16},
    "dots3_note": {"text_config": {"head_dim": 16}},
    # BltModel.forward builds DynamicCache(config=BltConfig) when use_cache, which raises (the
    # composite config has no num_hidden_layers); a scoring forward needs no cache
    # byte-level: the hash n-gram embedding is encoder_hash_byte_group_vocab x 6 groups rows
    # (3M x hidden by default) -> 1024 per group
    "blt": {"use_cache": False, "encoder_hash_byte_group_vocab": 1024},
    # MLM-style default: XLM attends both ways unless causal; a causal LM needs the triangular
    # mask (like is_decoder=True for the BERT family). (XLNet's attn_type="uni" would be the
    # same switch, but its forward then fails for batch > 1: the default "bi" stays.)
    "xlm": {"causal": True},
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    "xmod": {"default_language": "en_XX"},  # forward raises without a language
    # default pad id is out of a 49152 vocab and the field must be an int
    "emu3": {"text_config": {"pad_token_id": 0}},
    "modernbert-decoder": {"pad_token_id": 0},
    # qwen4_exp's indexed-attention layers need the QSA indexer sizes (all None by default)
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 16, "indexer_compress_ratio": 4},
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1,
                                  "indexer_head_dim": 16, "indexer_budget": 16,
                                  "indexer_compress_ratio": 4}},
    # gemma3n: the last num_kv_shared_layers reuse the KV of an earlier layer of the same type:
    # 4 layers = sliding, full, then a shared sliding and a shared full
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "intermediate_size": [INTERMEDIATE] * 4,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]},
}

# Types that cannot run a plain input_ids forward from a tiny config, with the reason.
EXCLUDED: dict[str, str] = {
    "gemma4_assistant": "speculative-decoding drafter: every layer reuses the target Gemma 4 "
    "model's KV (num_kv_shared_layers must equal num_hidden_layers) and forward raises "
    "'inputs_embeds and shared_kv_states cannot be None' without them",
    "gemma4_unified_assistant": "speculative-decoding drafter like gemma4_assistant: all layers "
    "read the target model's shared_kv_states (kv_sharing_modes raises when the drafter's own "
    "layers must produce a cache)",
    "musicgen": "audio-codebook decoder: the mapping's MusicgenConfig is the composite "
    "(text encoder + EnCodec + decoder) config, whose top level lacks the decoder fields "
    "MusicgenForCausalLM reads ('no attribute dropout'); its input_ids are "
    "(batch x num_codebooks, seq) audio codes and its logits are per codebook, not text",
    "musicgen_melody": "audio-codebook decoder, as musicgen (composite MusicgenMelodyConfig; "
    "input_ids are codebook streams, logits per codebook)",
    "gemma3n": "Gemma3nForConditionalGeneration builds its vision tower with TimmWrapperModel, "
    "which needs the timm package (not a project dependency, not installed); its text decoder "
    "is covered by gemma3n_text",
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layer_count(d: dict) -> tuple[str | None, int | None]:
    for k in LAYER_KEYS:
        if isinstance(d.get(k), int):
            return k, d[k]
    return None, None


def _pick_layers(d: dict, n: int) -> tuple[list[int], dict[str, list]]:
    """Indices of the default config's layers to keep so that every value of every per-layer list
    appears at least once (in model order), and those lists."""
    lists = {
        k: v for k, v in d.items()
        if isinstance(v, list) and len(v) == n and k not in INDEX_LISTS and n > 1
        and k not in ("eos_token_id", "architectures")
    }
    # an index list makes "is layer i in it" a per-layer property too
    flags = {k: [i in set(d[k]) for i in range(n)] for k in INDEX_LISTS
             if isinstance(d.get(k), list)}
    plc = d.get("per_layer_config")
    if isinstance(plc, dict):
        old = {int(i): v for i, v in plc.items()}
        flags["per_layer_config"] = [repr(old.get(i)) for i in range(n)]
    per_layer = {**lists, **flags}
    want: list[int] = []
    seen: set = set()
    for i in range(n):
        keys = {(k, repr(v[i])) for k, v in per_layer.items()}
        if keys - seen:
            want.append(i)
            seen |= keys
    want = want[:MAX_TINY_LAYERS]
    while len(want) < 2:
        want.append(next(i for i in range(n) if i not in want) if n > len(want) else 0)
    return sorted(want), lists


def _has_experts(d: dict) -> bool:
    return any(isinstance(d.get(k), int) and d[k] > 0 for k in _EXPERT_COUNT_KEYS)


_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def _shrink_sizes(d: dict) -> dict:
    """The size attributes of ``d`` (a config dict or one per-layer override dict), tiny."""
    kw: dict = {}
    for k, v in d.items():
        if k in SIZES and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            kw[k] = SIZES[k]
    # None = "required but unset" (the model would crash on the default config) or "derive"
    for k in FILL_IF_NONE:
        if k in d and d[k] is None:
            kw[k] = SIZES[k]
    if _has_experts(d):
        for k in FILL_IF_NONE_MOE:
            if k in d and d[k] is None:
                kw[k] = SIZES[k]
    if "kv_lora_rank" in d and "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = HEADS  # MLA: k/v are per head (up-projected from the latent)
    if "qk_rope_head_dim" in d:  # MLA: head_dim / qk_head_dim are derived from the parts
        kw.pop("head_dim", None)
        kw.pop("qk_head_dim", None)
        rope, nope = d["qk_rope_head_dim"], d.get("qk_nope_head_dim")
        if isinstance(d.get("head_dim"), int) and d["head_dim"] == rope:  # rope dim (longcat)
            kw["head_dim"] = SIZES["qk_rope_head_dim"]
        elif isinstance(d.get("head_dim"), int) and nope and d["head_dim"] == rope + nope:
            kw["head_dim"] = HEAD_DIM
        if "v_head_dim" in d:
            kw["v_head_dim"] = HEAD_DIM
    return kw


def _shrink(d: dict, vocab_size: int | None, window: int, *, text: bool = True) -> dict:
    """Tiny kwargs for a config class, from the default config's dict ``d``."""
    kw: dict = _shrink_sizes(d)
    for k, v in d.items():
        if k in SIZES:
            pass
        elif k in POSITION_KEYS and isinstance(v, int):
            kw[k] = MAX_POSITIONS
        elif text and k in WINDOW_KEYS and isinstance(v, int) and not isinstance(v, bool):
            kw[k] = window
        elif k in SHARED_EXPERT_KEYS and isinstance(v, int):
            kw[k] = min(v, 1)
        elif k in ("vocab_size", "unpadded_vocab_size") and vocab_size is not None:
            kw[k] = vocab_size
    if "intermediate_size" in d and isinstance(d["intermediate_size"], list):
        kw["intermediate_size"] = INTERMEDIATE  # per-layer list (gemma3n): rebuilt below
    lk, n = _layer_count(d)
    if lk is not None:
        keep, lists = _pick_layers(d, n)
        kw[lk] = len(keep)
        for k, v in lists.items():
            kw[k] = [kw.get(k, v) if k == "intermediate_size" else v[i] for i in keep]
        for k in INDEX_LISTS:
            if isinstance(d.get(k), list):
                kw[k] = [j for j, i in enumerate(keep) if i in set(d[k])]
        plc = d.get("per_layer_config")
        if isinstance(plc, dict):  # heterogeneous layers: {layer index: overrides}
            old = {int(i): v for i, v in plc.items()}
            kw["per_layer_config"] = {j: {**v, **_shrink_sizes(v)} for j, i in enumerate(keep)
                                      if (v := old.get(i)) is not None}
        for k in DENSE_PREFIX_KEYS:
            if isinstance(d.get(k), int) and d[k] > 0:
                kw[k] = sum(1 for i in keep if i < d[k])
    for k in ENCODER_LAYER_KEYS:
        if isinstance(d.get(k), int):
            kw[k] = 2
    if text and d.get("is_decoder") is False:
        kw["is_decoder"] = True  # encoder-family LM heads are bidirectional unless told
    if vocab_size is not None:
        pad = d.get("pad_token_id")
        if isinstance(pad, int) and pad >= vocab_size:
            kw["pad_token_id"] = None
    return kw


def _is_subconfig(v) -> bool:
    from transformers import PretrainedConfig

    return isinstance(v, PretrainedConfig)


def tiny_config(model_type: str, vocab_size: int, *, window: int = 16):
    """``AutoConfig.for_model(model_type, ...)`` shrunk to a tiny model (see module docstring)."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {}).get("_init", {}))
        kw = _shrink(base.to_dict(), vocab_size, window)
        for name, sub in list(vars(base).items()):
            if not _is_subconfig(sub):
                continue
            is_text = name in ("text_config", "decoder_config", "global_config", "encoder_config",
                               "depth_decoder_config", "per_layer_config",
                               "patcher_config")
            skw = _shrink(sub.to_dict(), vocab_size if is_text else None, window, text=is_text)
            skw.update(OVERRIDES.get(model_type, {}).get(name, {}))
            sd = sub.to_dict()
            sd.update(skw)
            for k in list(sd):
                if k in ("layer_types", "mlp_layer_types") and k not in skw:
                    sd.pop(k)
            kw[name] = sd
        kw.update({k: v for k, v in OVERRIDES.get(model_type, {}).items()
                   if k != "_init" and not (isinstance(v, dict) and k in kw
                                            and isinstance(kw[k], dict))})
        cfg = AutoConfig.for_model(model_type, **kw)
    return cfg


def tiny_model(model_type: str, vocab_size: int, *, window: int = 16, seed: int = 0):
    """A tiny random fp32 causal LM of ``model_type`` in eval mode (deterministic in ``seed``)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, vocab_size, window=window)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.float().eval()


# How the LM head output is post-processed beyond `logits = lm_head(hidden)` (read from each
# CausalLM forward in transformers 5.24): model_type -> (config attribute, formula).
_SOFTCAP = "tanh(logits / c) * c"
LOGIT_POSTPROCESS: dict[str, tuple[str, str]] = {
    **{t: ("logit_scale", "lm_head(h) * logit_scale")
       for t in ("cohere", "cohere2", "cohere2_moe", "cohere_compass_text")},
    **{t: ("logits_scaling", "lm_head(h) / logits_scaling")
       for t in ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                 "granitemoeshared")},
    "hyperclovax": ("logits_scaling", "lm_head(h) * logits_scaling"),
    "minicpm3": ("logits_scaling", "lm_head(h / logits_scaling)"),
    "falcon_h1": ("lm_head_multiplier", "lm_head(h) * lm_head_multiplier"),
    "inkling_text": ("logits_mup_width_multiplier",
                     "lm_head(h / logits_mup_width_multiplier)[..., :unpadded_vocab_size]"),
    **{t: ("final_logit_softcapping", _SOFTCAP)
       for t in ("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4",
                 "gemma4_text", "gemma4_unified", "gemma4_unified_text", "vaultgemma",
                 "nanochat", "beam", "inkling2_text", "inkling2_loop_text")},
    "recurrent_gemma": ("logits_soft_cap", _SOFTCAP),
    "xlstm": ("output_logit_soft_cap", _SOFTCAP),
}
# families whose every mixer is recurrent (no layer_types list to read it from)
_RECURRENT_FAMILIES = {"mamba": "mamba", "falcon_mamba": "mamba", "mamba2": "mamba2",
                       "rwkv": "rwkv", "xlstm": "mlstm", "falcon_h1": "mamba2 || attention",
                       "bamba": "mamba2", "jamba": "mamba", "zamba": "mamba", "zamba2": "mamba2",
                       "nemotron_h": "mamba2", "granitemoehybrid": "mamba2",
                       "recurrent_gemma": "rg-lru", "lfm2": "short conv", "lfm2_moe": "short conv",
                       "lfm3": "short conv", "qwen3_next": "gated deltanet"}
# the output Linear is a direct child but its forward first applies a sibling transform:
# electra generator_lm_head(generator_predictions(h)), modernbert decoder(lm_head(h)) with lm_head
# = dense + act + norm
_TRANSFORM_BEFORE_HEAD = ("electra", "modernbert-decoder")
_LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types", "attn_layers",
                    "attention_layers")


def _module_source(model_type: str) -> str:
    import inspect
    import sys

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return inspect.getsource(sys.modules[cls.__module__])


def attention_features(cfg, model=None) -> dict:
    """What a (tiny) config exercises; ``model`` adds whether the LM head is a plain Linear."""
    t = cfg.model_type
    mt = t if t in causal_lm_types() else None
    text = cfg.get_text_config(decoder=True)
    td = text.to_dict()
    src = _module_source(mt) if mt else ""
    kinds = next((td[k] for k in _LAYER_KIND_KEYS if isinstance(td.get(k), list)), None)
    n = next((td[k] for k in LAYER_KEYS if isinstance(td.get(k), int)), None)
    f: dict = {"layers": n if n is not None else (len(kinds) if kinds else None)}
    if kinds:
        f["layer_kinds"] = kinds
    f["window"] = {k: td[k] for k in WINDOW_KEYS if isinstance(td.get(k), int)
                   and not isinstance(td[k], bool)}
    # whether some layer really is windowed: a layer kind says so, or no layer is plain
    # "full_attention" (recurrent_gemma's local "attention", deepseek_v4's compressed kinds), or
    # (no kinds) the window applies to every layer (mistral-style); qwen2-style
    # use_sliding_window=False drops it
    f["window_used"] = bool(f["window"]) and (
        any(("sliding" in k or "chunk" in k or k == "local") for k in kinds)
        or "full_attention" not in kinds
        if kinds
        else True
    )
    if "use_sliding_window" in td:
        f["window"]["use_sliding_window"] = td["use_sliding_window"]
    f["softcaps"] = {k: v for k, v in td.items()
                     if ("softcap" in k or "soft_cap" in k) and v is not None}
    f["logit_postprocess"] = LOGIT_POSTPROCESS.get(t)
    f["sinks"] = "sinks" in src
    f["mla"] = td.get("kv_lora_rank") is not None
    rope = td.get("rope_parameters") or {}
    prf = [v.get("partial_rotary_factor") for v in (rope.values() if all(
        isinstance(v, dict) for v in rope.values()) and rope else [rope])]
    prf = [x for x in prf + [td.get("partial_rotary_factor")] if x is not None and x < 1]
    if prf or td.get("rotary_dim"):
        f["partial_rotary"] = prf[0] if prf else f"rotary_dim={td['rotary_dim']}"
    if isinstance(td.get("no_rope_layers"), list):
        f["nope_layers"] = [i for i, r in enumerate(td["no_rope_layers"]) if not r]
    rec = _RECURRENT_FAMILIES.get(t)
    if kinds:
        other = sorted({k for k in kinds if ("attention" not in k or k == "linear_attention")
                        and k not in ("mlp", "moe")
                        and k not in ("global", "local", "lsh", "hybrid_sliding", "hybrid")})
        if other:
            rec = f"{rec or ''} {other}".strip()
    f["recurrent"] = rec
    f["alibi"] = "alibi" in src and (td.get("alibi", True) or
                                     (td.get("attn_config") or {}).get("alibi", False))
    if model is not None:
        head = model.get_output_embeddings()
        # a bare nn.Linear applied to the base model's final hidden states (post-processing,
        # if any, is in logit_postprocess); False for prediction heads (dense + act + norm)
        f["lm_head_plain_linear"] = (isinstance(head, torch.nn.Linear)
                                     and t not in _TRANSFORM_BEFORE_HEAD
                                     and not any(True for _ in _head_wrappers(model)))
    return f


def _head_wrappers(model):
    """Modules that wrap the output projection (e.g. BERT's transform + decoder head)."""
    head = model.get_output_embeddings()
    for _name, m in model.named_children():
        if m is not head and any(c is head for c in m.modules()):
            yield head  # the Linear sits inside a prediction head: not plain


def check(model_type: str, vocab_size: int = 49152, *, seq: int = 40, pad: int = 10) -> dict:
    """Build + forward (batch 2 x ``seq``) + a right-padded batch; the report's row for a type."""
    import time

    row: dict = {"type": model_type}
    t0 = time.perf_counter()
    model = tiny_model(model_type, vocab_size)
    row["build_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, seq), generator=g)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    row["forward_s"] = time.perf_counter() - t0
    row["shape_ok"] = tuple(logits.shape) == (2, seq, vocab_size)
    row["finite"] = bool(torch.isfinite(logits).all())
    n = seq - pad
    padded = ids.clone()
    padded[0, n:] = 0
    mask = torch.ones_like(ids)
    mask[0, n:] = 0
    with torch.no_grad():
        alone = model(input_ids=ids[:1, :n]).logits[0]
        batch = model(input_ids=padded, attention_mask=mask).logits[0, :n]
    row["pad_diff"] = float((alone - batch).abs().max())
    changed = ids.clone()
    changed[:, n] = (changed[:, n] + 1) % vocab_size
    with torch.no_grad():
        after = model(input_ids=changed).logits
    row["causal_diff"] = float((after[:, :n] - logits[:, :n]).abs().max())
    row["features"] = attention_features(model.config, model)
    return row


def main() -> None:
    import json
    import signal
    import sys
    import time

    types = sys.argv[1:] or causal_lm_types()

    def alarm(*_):
        raise TimeoutError("over 120 s")

    signal.signal(signal.SIGALRM, alarm)
    t_all = time.perf_counter()
    for t in types:
        if t in EXCLUDED:
            print(json.dumps({"type": t, "excluded": EXCLUDED[t]}), flush=True)
            continue
        signal.alarm(120)
        try:
            row = check(t)
        except Exception as e:  # noqa: BLE001 - the report records every failure
            row = {"type": t, "error": f"{type(e).__name__}: {e}"[:400]}
        finally:
            signal.alarm(0)
        print(json.dumps(row), flush=True)
    print(json.dumps({"total_s": time.perf_counter() - t_all}))


if __name__ == "__main__":
    main()
