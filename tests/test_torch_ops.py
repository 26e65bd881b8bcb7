"""icqs_fast.torch_ops: the torch.library registrations (opcheck, torch.compile, torch.export).

CPU tensors throughout: the ops dispatch to the cpp (or torch) backend here, so what is tested is
the registration (schemas, fake implementations, autograd formula), not the kernels, which have
their own tests.
"""

import pytest
import torch

from icqs_fast import ops
from icqs_fast import torch_ops as T
from icqs_fast.compat import trl as compat
from icqs_fast.types import TokenStats

DTYPES = [torch.float32, torch.bfloat16]
V = 37  # not a multiple of any block size


def _stats_inputs(dtype):
    z = (torch.randn(2, 5, V) * 3).to(dtype)
    t = torch.randint(0, V, (2, 5))
    t[0, 1] = -100  # a masked row
    t[1, 4] = -100
    return z, t


def _linear_inputs(dtype):
    h = torch.randn(7, 16).to(dtype)
    w = (torch.randn(V, 16) * 0.5).to(dtype)
    b = torch.randn(V).to(dtype)
    t = torch.randint(0, V, (7,))
    t[3] = -100
    return h, w, b, t


def _assert_stats_equal(a: TokenStats, b: TokenStats):
    for k, x in a.as_dict().items():
        y = getattr(b, k)
        assert x.shape == y.shape and x.dtype == y.dtype, k
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_token_stats(dtype):
    z, t = _stats_inputs(dtype)
    torch.library.opcheck(torch.ops.icqs_fast.token_stats.default, (z, t, -100, 0.7, "auto"))
    # A strided (non-contiguous) logits view goes through the same checks.
    torch.library.opcheck(torch.ops.icqs_fast.token_stats.default,
                          (z[:, :, :30], t.clamp_max(29), -100, 1.0, "torch"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_linear_token_stats(dtype):
    h, w, b, t = _linear_inputs(dtype)
    # Small chunks so the chunked path runs several token and vocabulary blocks.
    torch.library.opcheck(torch.ops.icqs_fast.linear_token_stats.default,
                          (h, w, t, b, -100, 1.3, "auto", 3, 16))
    torch.library.opcheck(torch.ops.icqs_fast.linear_token_stats.default,
                          (h, w, t, None, -100, 1.0, "torch", 256, 16384))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_opcheck_trl_ops(dtype):
    x = (torch.randn(6, V) * 2).to(dtype).requires_grad_(True)
    idx = torch.randint(0, V, (6, 3))
    # requires_grad inputs: opcheck also compares the registered backward under AOT autograd
    # with eager.
    torch.library.opcheck(torch.ops.icqs_fast.selective_log_softmax.default, (x, idx, 0.8))
    torch.library.opcheck(torch.ops.icqs_fast.entropy_from_logits.default, (x,))
    xd = x.detach()
    out, lse = torch.ops.icqs_fast.selective_log_softmax(xd, idx, 0.8)
    ent, lse1 = torch.ops.icqs_fast.entropy_from_logits(xd)
    torch.library.opcheck(torch.ops.icqs_fast.selective_log_softmax_backward.default,
                          (torch.randn(6, 3), xd, idx, lse, 0.8))
    torch.library.opcheck(torch.ops.icqs_fast.entropy_from_logits_backward.default,
                          (torch.randn(6), xd, lse1, ent))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrappers_equal_ops(dtype):
    z, t = _stats_inputs(dtype)
    kw = dict(temperature=0.7)
    _assert_stats_equal(T.token_stats(z, t, **kw), ops.token_stats(z, t, **kw))
    h, w, b, t = _linear_inputs(dtype)
    kw = dict(bias=b, temperature=1.3, chunk_tokens=3, chunk_vocab=16)
    _assert_stats_equal(T.linear_token_stats(h, w, t, **kw), ops.linear_token_stats(h, w, t, **kw))


def test_errors_pass_through():
    z, t = _stats_inputs(torch.float32)
    t[0, 0] = V  # outside the vocabulary: a data-dependent check, made by the real implementation
    with pytest.raises(ValueError, match="outside the vocabulary"):
        T.token_stats(z, t)
    with pytest.raises(ValueError, match="temperature"):
        T.token_stats(z, t.clamp_max(V - 1), temperature=0.0)
    h, w, b, t = _linear_inputs(torch.float32)
    with pytest.raises(ValueError, match="hidden must be"):
        T.linear_token_stats(h[:, :8], w, t)


@pytest.mark.slow
def test_compile_fullgraph_stats_ops_inductor():
    """One inductor compile (fullgraph: any graph break fails) of both statistics ops."""

    def f(z, t, h, w, tt, b):
        s = T.token_stats(z, t, temperature=0.7)
        s2 = T.linear_token_stats(h, w, tt, bias=b, chunk_tokens=3, chunk_vocab=16)
        return s.logprob, s.is_greedy, s.target_rank, s2.entropy, s2.valid, s2.varentropy

    z, t = _stats_inputs(torch.float32)
    h, w, b, tt = _linear_inputs(torch.float32)
    got = torch.compile(f, fullgraph=True)(z, t, h, w, tt, b)
    want = f(z, t, h, w, tt, b)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.slow
def test_compile_fullgraph_trl_forward_backward():
    """The TRL helpers, forward and backward, traced whole by dynamo and AOT autograd (the
    registered backward formula). ``aot_eager`` rather than inductor: the ops are opaque to
    inductor either way, and a second inductor compile (with its backward graph) costs ~20 s of
    CPU here."""

    def g(x, idx, mask):
        lp = compat.selective_log_softmax(x, idx, temperature=0.8, row_mask=mask)
        return (lp * 2).sum() + compat.entropy_from_logits(x).sum()

    x1 = (torch.randn(3, 4, V) * 2).requires_grad_(True)
    x2 = x1.detach().clone().requires_grad_(True)
    idx = torch.randint(0, V, (3, 4))
    mask = torch.ones(3, 4)
    mask[1, 2] = 0
    got = torch.compile(g, fullgraph=True, backend="aot_eager")(x1, idx, mask)
    got.backward()
    want = g(x2, idx, mask)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x1.grad, x2.grad)
    assert x1.grad.abs().sum() > 0


class _Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, V)

    def forward(self, hidden, targets, logits, index):
        s = T.linear_token_stats(hidden, self.head.weight, targets, bias=self.head.bias)
        u = T.token_stats(logits, index, temperature=0.9)
        lp = compat.selective_log_softmax(logits, index.clamp_min(0))
        return s.logprob, s.is_greedy, u.entropy, lp, compat.entropy_from_logits(logits)


def test_export():
    """One export with a symbolic token count and batch size (the fake implementations' shapes
    follow them), run on the example inputs and on inputs of other sizes."""
    m = _Scorer()
    h, _, _, t = _linear_inputs(torch.float32)
    z, idx = _stats_inputs(torch.float32)
    n, b = torch.export.Dim("n", min=2), torch.export.Dim("b", min=2)
    ep = torch.export.export(m, (h, t, z, idx), dynamic_shapes=({0: n}, {0: n}, {0: b}, {0: b}))
    called = {str(x.target) for x in ep.graph.nodes if x.op == "call_function"}
    for op in ("token_stats", "linear_token_stats", "selective_log_softmax",
               "entropy_from_logits"):
        assert f"icqs_fast.{op}.default" in called, (op, called)
    h2 = torch.randn(11, 16)
    t2 = torch.randint(0, V, (11,))
    t2[5] = -100
    z2 = torch.randn(3, 5, V)
    idx2 = torch.randint(0, V, (3, 5))
    for args in ((h, t, z, idx), (h2, t2, z2, idx2)):
        got, want = ep.module()(*args), m(*args)
        for g, e in zip(got, want, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype
            torch.testing.assert_close(g, e, atol=0, rtol=0)
