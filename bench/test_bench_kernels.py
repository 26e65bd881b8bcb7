"""token_stats on the cpp backend vs the unfused torch sequence, fp32 [2048, 49152] on the CPU.

Run: ``pytest bench --benchmark-only`` (compare the two rows of the group; target >= 3x).
"""

import pytest
import torch

from bench.conftest import SHAPE
from icqs_fast import ops
from icqs_fast.backends import cpp_backend
from icqs_fast.benchmarks.kernels import baseline_token_stats

GROUP = f"token_stats fp32 {list(SHAPE)} cpu"

pytestmark = pytest.mark.kernels


@pytest.mark.skipif(not cpp_backend.available()[0], reason="icqs_fast._C is not built")
def test_token_stats_cpp(benchmark, logits_targets):
    z, t = logits_targets
    benchmark.group = GROUP
    out = benchmark.pedantic(lambda: ops.token_stats(z, t, backend="cpp"), rounds=7,
                             warmup_rounds=1)
    # Same numbers as the baseline on the fields both compute.
    lp, ent, var = baseline_token_stats(z, t)
    assert torch.allclose(out.logprob, lp, atol=1e-4)
    assert torch.allclose(out.entropy, ent, atol=1e-4)
    assert torch.allclose(out.logprob_var, var, rtol=1e-4, atol=1e-4)


def test_token_stats_torch_baseline(benchmark, logits_targets):
    z, t = logits_targets
    benchmark.group = GROUP
    lp, ent, var = benchmark.pedantic(lambda: baseline_token_stats(z, t), rounds=3,
                                      warmup_rounds=1)
    assert lp.shape == ent.shape == var.shape == t.shape
    assert bool(torch.isfinite(ent).all()) and bool((ent >= 0).all())
