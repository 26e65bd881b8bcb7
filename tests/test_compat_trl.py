"""icqs_fast.compat.trl against TRL's own helpers (same signatures, shapes, dtypes, gradients)
and against float64 computations of the same inputs (TRL itself works in bf16 for bf16 logits,
so it is only a loose reference there; float64 pins our values to the output's rounding)."""

import pytest
import torch
import trl.trainer.utils as trl_utils  # TRL is in the dev extras: a missing one must fail

from icqs_fast.compat import trl as compat

# Against TRL: in bf16 TRL's own log_softmax/entropy are off by a few bf16 ulps.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}
# Against float64: the rounding of the output dtype (bf16: 8 significant bits).
TOL64 = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2**-8)}


def _lsm64(logits, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_matches_trl(dtype, temperature):
    logits = (torch.randn(3, 5, 1003) * 3).to(dtype)
    index = torch.randint(0, 1003, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 2] = 0
    ours = compat.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
    ref = trl_utils.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    want = _lsm64(logits, temperature).gather(-1, index[..., None])[..., 0]
    want[1, 2] = 0
    torch.testing.assert_close(ours.double(), want, **TOL64[dtype])
    assert ours[1, 2] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_topk_index(dtype):
    logits = (torch.randn(4, 2, 517) * 2).to(dtype)
    index = torch.randint(0, 517, (4, 2, 3))
    ours = compat.selective_log_softmax(logits, index)
    ref = trl_utils.selective_log_softmax(logits, index)
    assert ours.shape == (4, 2, 3) and ours.dtype == ref.dtype
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(ours.double(), _lsm64(logits).gather(-1, index), **TOL64[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_trl(dtype):
    logits = (torch.randn(2, 3, 4, 999) * 4).to(dtype)
    ours = compat.entropy_from_logits(logits, chunk_size=5)
    ref = trl_utils.entropy_from_logits(logits, chunk_size=5)
    assert ours.shape == ref.shape == (2, 3, 4) and ours.dtype == ref.dtype
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    lsm = _lsm64(logits)
    torch.testing.assert_close(ours.double(), -(lsm.exp() * lsm).sum(-1), **TOL64[dtype])


def test_gradients_match_trl():
    base = torch.randn(6, 301, dtype=torch.float32) * 2
    index = torch.randint(0, 301, (6,))
    weights = torch.randn(6)
    grads = []
    for fn_lp, fn_ent in [(compat.selective_log_softmax, compat.entropy_from_logits),
                          (trl_utils.selective_log_softmax, trl_utils.entropy_from_logits)]:
        x = base.clone().requires_grad_(True)
        loss = (fn_lp(x, index, temperature=0.8) * weights).sum() + fn_ent(x).sum() * 0.3
        loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_errors():
    with pytest.raises(ValueError, match="temperature"):
        compat.selective_log_softmax(torch.randn(2, 5), torch.tensor([0, 1]), temperature=0)
    with pytest.raises(ValueError, match="does not match"):
        compat.selective_log_softmax(torch.randn(2, 5), torch.tensor([[0, 1, 2]]))
