"""The memory plan before the first forward (issue 49, items 7 and 8): the prefix bank,
activations and head from the model's config against the device's free memory; a bank that
cannot fit is refused with its numbers and the flags, forwards too large are split; a
continuation bank's cap follows the GPU's memory; CUDA's allocator gets expandable segments."""

import os

import pytest
from transformers import LlamaConfig

from icqs_fast.engine import memory_plan as mp

GIB = 1 << 30
LLAMA2_7B = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, intermediate_size=11008, vocab_size=32000)


def test_the_bank_of_a_7b_model_is_half_a_mib_per_token():
    assert mp.bank_bytes(LLAMA2_7B, entries=1, p_max=1, element_size=2) == 512 * 1024
    # 21 ratios x 16 sets of 1,000-token prefixes: 164 GiB
    assert mp.bank_bytes(LLAMA2_7B, 336, 1000, 2) / GIB == pytest.approx(164.06, abs=0.01)


def test_a_bank_that_cannot_fit_is_refused_with_its_numbers():
    with pytest.raises(ValueError) as e:
        mp.plan_memory(LLAMA2_7B, entries=336, p_max=1000, token_budget=16384,
                       element_size=2, free_bytes=80 * GIB)
    msg = str(e.value)
    assert "164.06 GiB (336 demonstration contexts x 1000 tokens)" in msg
    assert "80.00 GiB free" in msg and "--num-ratios / --sets-per-ratio" in msg


def test_forwards_too_large_are_split_to_fit():
    kw = dict(entries=20, p_max=1000, element_size=2)
    roomy = mp.plan_memory(LLAMA2_7B, token_budget=16384, free_bytes=80 * GIB, **kw)
    assert roomy.token_budget == 16384 and not roomy.split
    tight = mp.plan_memory(LLAMA2_7B, token_budget=16384, free_bytes=12 * GIB, **kw)
    assert mp.MIN_TOKEN_BUDGET < tight.token_budget < 16384 and tight.split
    used = tight.bank_bytes + tight.head_bytes + tight.per_token_bytes * tight.token_budget
    assert used <= 12 * GIB * mp.HEADROOM < used + tight.per_token_bytes
    assert "--token-budget 16384 lowered to" in tight.line()
    cpu = mp.plan_memory(LLAMA2_7B, token_budget=16384, free_bytes=None, **kw)
    assert cpu.token_budget == 16384 and "free" not in cpu.line()  # reported only


def test_bank_cap_follows_the_gpu(monkeypatch):
    assert mp.bank_cap_bytes("cpu") == mp.CPU_BANK_BYTES
    monkeypatch.setattr(mp, "free_device_bytes", lambda device: 60 * GIB)
    assert mp.bank_cap_bytes("cuda") == 15 * GIB  # was 512 MiB: ~1,024 tokens of a 7B model
    monkeypatch.setattr(mp, "free_device_bytes", lambda device: GIB)
    assert mp.bank_cap_bytes("cuda") == mp.CPU_BANK_BYTES  # never below the CPU's


def test_the_cli_sets_expandable_segments(monkeypatch):
    from icqs_fast.cli import CUDA_ALLOC_ENV, main

    monkeypatch.delenv(CUDA_ALLOC_ENV, raising=False)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ[CUDA_ALLOC_ENV] == "expandable_segments:True"
    monkeypatch.setenv(CUDA_ALLOC_ENV, "max_split_size_mb:128")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ[CUDA_ALLOC_ENV] == "max_split_size_mb:128"  # one's own stands
