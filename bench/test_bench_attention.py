"""Attention-entropy features of the embedded model: capture_attention_entropy (chunked torch
path on the CPU, Triton on CUDA) vs eager ``output_attentions=True`` + entropies from the matrices.

Run: ``pytest bench --benchmark-only -k attention`` (compare the two rows of the group; target
>= 2x on the CPU at 1024 tokens). ``ICQS_BENCH_QUICK=1`` uses 128 tokens.
"""

import pytest
import torch

from bench.conftest import DEVICE, QUICK
from icqs_fast.benchmarks.attention import make_inputs, run_eager, run_ours

SEQ = 128 if QUICK else 1024
GROUP = f"attention entropy SmolLM2-135M {SEQ} tokens {DEVICE.type}"


@pytest.fixture(scope="module")
def model_inputs(embedded):
    model, _ = embedded
    return (model, *make_inputs(model.config.vocab_size, SEQ, DEVICE))


def test_attention_entropy_ours(benchmark, model_inputs):
    model, ids, qm, kr = model_inputs
    benchmark.group = GROUP
    ent = benchmark.pedantic(lambda: run_ours(model, ids, qm, kr), rounds=3, warmup_rounds=1)
    want = run_eager(model, ids, qm, kr)
    # bf16 on CUDA: the two sides round differently inside the model, so compare loosely there.
    tol = 1e-4 if DEVICE.type == "cpu" else 5e-2
    assert torch.allclose(ent, want, atol=tol), (ent - want).abs().max()


def test_attention_entropy_eager(benchmark, model_inputs):
    model, ids, qm, kr = model_inputs
    benchmark.group = GROUP
    ent = benchmark.pedantic(lambda: run_eager(model, ids, qm, kr), rounds=3, warmup_rounds=1)
    cfg = model.config
    assert ent.shape == (1, cfg.num_hidden_layers, cfg.num_attention_heads, SEQ)
    assert bool(torch.isfinite(ent).all()) and float(ent[..., SEQ // 2:].min()) > 0
