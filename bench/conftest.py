"""pytest-benchmark setup for ``pytest bench --benchmark-only`` (not part of the normal test run:
``testpaths = tests``). Shapes can be shrunk for a smoke run with ``ICQS_BENCH_QUICK=1``."""

import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "kernels: token-statistics kernel benchmarks")


QUICK = os.environ.get("ICQS_BENCH_QUICK", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPE = (64, 4096) if QUICK else (2048, 49152)


@pytest.fixture(scope="session")
def logits_targets():
    """``[2048, 49152]`` fp32 logits ~ N(0, 4^2) (SmolLM2's vocabulary) and int64 targets."""
    gen = torch.Generator().manual_seed(0)
    n, v = SHAPE
    return torch.randn(n, v, generator=gen) * 4, torch.randint(0, v, (n,), generator=gen)


@pytest.fixture(scope="session")
def embedded():
    """``(model, tokenizer)``: the embedded SmolLM2-135M with sdpa attention on ``DEVICE``."""
    from icqs_fast.models import load_model

    try:
        return load_model(device=DEVICE, dtype="float32", attn_implementation="sdpa")
    except FileNotFoundError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
