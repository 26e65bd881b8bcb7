"""ICQS engine vs the naive method on the embedded model (a small version of
``icqs-fast bench icqs``): 4 financial-news responses, 5 ratios, L = 1 set per ratio, N = 8.

Run: ``pytest bench --benchmark-only -k icqs`` and compare the rows of the group (the engine row
has its prefix caches already built; ``icqs-fast bench icqs`` reports the cold numbers too).
``ICQS_BENCH_QUICK=1`` scores 2 responses.
"""

import pytest
import torch

from bench.conftest import DEVICE, QUICK
from icqs_fast.benchmarks.icqs import demos, responses
from icqs_fast.data import TEMPLATE
from icqs_fast.engine.reference import icqs_naive
from icqs_fast.engine.scorer import ICQSScorer

N_RESP = 2 if QUICK else 4
KW = dict(num_ratios=5, demos_per_set=8, sets_per_ratio=1, seed=0, template=TEMPLATE)
GROUP = f"ICQS SmolLM2-135M {N_RESP} responses x 5 contexts {DEVICE.type}"


@pytest.fixture(scope="module")
def setup(embedded):
    model, tok = embedded
    good, bad = demos()
    return model, tok, good, bad, responses(N_RESP)


def test_icqs_engine(benchmark, setup):
    model, tok, good, bad, resp = setup
    benchmark.group = GROUP
    scorer = ICQSScorer(model, tok, good, bad, **KW)
    scorer.prefix_bank  # noqa: B018  (prefix caches built outside the timing)
    got = benchmark.pedantic(lambda: list(scorer.score(resp)), rounds=3, warmup_rounds=1)
    ref = icqs_naive(model, tok, good, bad, resp[:1], **KW)
    assert got[0].score == ref[0].score
    assert torch.allclose(got[0].loglik, ref[0].loglik, atol=1e-3)


def test_icqs_naive(benchmark, setup):
    model, tok, good, bad, resp = setup
    benchmark.group = GROUP
    out = benchmark.pedantic(lambda: icqs_naive(model, tok, good, bad, resp, **KW), rounds=1,
                             warmup_rounds=0)
    assert len(out) == N_RESP
