"""icqs_fast.compat.verl.linear_logprobs_entropy against a float64 full-logits computation."""

import pytest
import torch

from icqs_fast.compat.verl import linear_logprobs_entropy

H = 24
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-4, rtol=2e-4)}


def full64(hidden, weight, labels, temperature):
    """verl's reference semantics in float64: logits / T, then log-softmax at the label and
    entropy = logsumexp(z) - sum(p z) (what verl's kernels compute), from the same input values."""
    z = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t() / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, labels.reshape(-1, 1))[:, 0]
    ent = torch.logsumexp(z, -1) - (logp.exp() * z).sum(-1)
    return lp.reshape(labels.shape), ent.reshape(labels.shape)


def _inputs(lead, v, dtype):
    hidden = torch.randn(*lead, H).to(dtype)
    weight = (torch.randn(v, H) * 3 / H**0.5).to(dtype)
    labels = torch.randint(0, v, lead)
    return hidden, weight, labels


def _check(got, want, dtype):
    for g, w, name in zip(got, want, ("logprobs", "entropy"), strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        torch.testing.assert_close(g.double(), w, **TOL[dtype],
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("lead,v", [((2, 9), 1003), ((1,), 1003), ((1, 1), 130), ((37,), 257)])
def test_matches_float64(dtype, temperature, lead, v):
    """V never a multiple of 128; N = 1; [B, T, H] and [N, H] hidden states."""
    hidden, weight, labels = _inputs(lead, v, dtype)
    with torch.no_grad():
        got = linear_logprobs_entropy(hidden, weight, labels, temperature)
    _check(got, full64(hidden, weight, labels, temperature), dtype)


def test_backend_passed_through():
    # The torch backend instead of "auto" (cpp here); the Triton path of linear_token_stats is
    # tested in test_linear_token_stats (20 s for even a tiny case in Triton's CPU interpreter).
    hidden, weight, labels = _inputs((3, 5), 300, torch.float32)
    with torch.no_grad():
        got = linear_logprobs_entropy(hidden, weight, labels, 0.8, backend="torch")
    _check(got, full64(hidden, weight, labels, 0.8), torch.float32)


def test_flat_labels_and_reductions():
    hidden, weight, labels = _inputs((2, 6), 515, torch.float32)
    lp, ent = full64(hidden, weight, labels, 1.3)
    with torch.no_grad():
        # verl flattens labels: a [N] label vector for [B, T, H] hidden states is accepted.
        got = linear_logprobs_entropy(hidden, weight, labels.reshape(-1), 1.3)
        _check(got, (lp.reshape(-1), ent.reshape(-1)), torch.float32)
        s, e = linear_logprobs_entropy(hidden, weight, labels, 1.3, "sum")
        m, e2 = linear_logprobs_entropy(hidden, weight, labels, 1.3, "mean")
    assert s.shape == m.shape == () and e.shape == e2.shape == labels.shape
    torch.testing.assert_close(s.double(), lp.sum(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(m.double(), lp.mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.double(), ent, atol=2e-5, rtol=2e-5)


def test_mixed_dtypes_promote():
    # A bf16 body with an fp32 head: computed from the fp32 promotion of both.
    hidden, weight, labels = _inputs((4,), 200, torch.float32)
    hidden = hidden.bfloat16()
    with torch.no_grad():
        got = linear_logprobs_entropy(hidden, weight, labels)
    _check(got, full64(hidden, weight, labels, 1.0), torch.float32)


def test_errors():
    hidden, weight, labels = _inputs((2, 3), 50, torch.float32)
    bad = labels.clone()
    bad[1, 2] = -100  # verl has no ignore_index: a label outside [0, V) is an error here
    with torch.no_grad():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            linear_logprobs_entropy(hidden, weight, bad)
        with pytest.raises(ValueError, match="one id per hidden row"):
            linear_logprobs_entropy(hidden, weight, labels[:, :2])
        with pytest.raises(ValueError, match="weight"):
            linear_logprobs_entropy(hidden, weight[:, :5], labels)
        with pytest.raises(ValueError, match="reduction"):
            linear_logprobs_entropy(hidden, weight, labels, reduction="avg")
        with pytest.raises(ValueError, match="temperature"):
            linear_logprobs_entropy(hidden, weight, labels, temperature=0.0)
    w = weight.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="no_grad"):
        linear_logprobs_entropy(hidden, w, labels)


@pytest.mark.slow
def test_compiles_fullgraph():
    # Through linear_token_stats' torch.library op: traced whole (any graph break fails).
    hidden, weight, labels = _inputs((2, 3), 130, torch.float32)
    f = torch.compile(linear_logprobs_entropy, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = f(hidden, weight, labels, 0.7)
        want = linear_logprobs_entropy(hidden, weight, labels, 0.7)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
