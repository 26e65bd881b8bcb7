"""A tiny Llama GGUF file written from scratch (random float32 weights, a byte-level BPE
tokenizer of 256 bytes and a few merges), for the GGUF loading tests: a few hundred KB, read by
transformers' GGUF reader in well under a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a"]


def write_tiny_gguf(path: str | Path, *, seed: int = 0, architecture: str = "llama") -> Path:
    """A tiny causal LM of ``architecture``'s tensor names (llama's) at ``path``; another
    ``architecture`` name makes a file transformers' reader cannot map."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens = _byte_tokens() + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-test-llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN))
                     .astype(np.float32))
        t(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        t(f"blk.{i}.attn_k.weight", HIDDEN * KV_HEADS // HEADS, HIDDEN)
        t(f"blk.{i}.attn_v.weight", HIDDEN * KV_HEADS // HEADS, HIDDEN)
        t(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN))
                     .astype(np.float32))
        t(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    t("output.weight", vocab, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
