"""linear_token_stats with a bf16 LM head on the CPU backends: each vocabulary block of the
weight is converted to fp32 once per call, not once per token chunk, and the numbers still match
the float64 reference (issue 38, item 3)."""

import pytest
import torch
from test_token_stats import compare, logit_refs
from torch.utils._python_dispatch import TorchDispatchMode

from icqs_fast import ops


class _CountWeightCasts(TorchDispatchMode):
    """Counts dtype conversions whose source is a bf16 ``[rows, H]`` block of more than
    ``min_rows`` rows (weight blocks; the gathered target rows are ``[c, H]`` with c smaller)."""

    def __init__(self, h: int, min_rows: int):
        super().__init__()
        self.h, self.min_rows, self.count = h, min_rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if (func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)
                and isinstance(src, torch.Tensor) and src.dtype == torch.bfloat16
                and src.dim() == 2 and src.shape[1] == self.h and src.shape[0] > self.min_rows):
            self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_bf16_weight_converted_once_per_block(backend):
    if backend == "cpp":
        from icqs_fast.backends import cpp_backend
        if not cpp_backend.available()[0]:
            pytest.skip(cpp_backend.available()[1])
    torch.manual_seed(0)
    n, h, v, ct, cv = 50, 16, 700, 8, 200  # 7 token chunks, 4 vocabulary blocks
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5 * 3).bfloat16()
    t = torch.randint(0, v, (n,))
    t[5] = -100
    with _CountWeightCasts(h, ct) as mode:
        out = ops.linear_token_stats(hid, w, t, backend=backend, chunk_tokens=ct,
                                     chunk_vocab=cv)
    blocks = -(-v // cv)
    if backend == "torch":
        assert mode.count == blocks, f"{mode.count} weight-block conversions for {blocks} blocks"
    else:
        # The cpp blocks are packed by the C++ kernel straight from bf16 (no torch cast), once
        # per weight: a second call packs nothing.
        assert mode.count == 0, f"{mode.count} torch weight conversions on cpp"
        from icqs_fast.backends import cpp_backend

        packs = []
        real = cpp_backend.pack_linear
        cpp_backend.pack_linear = lambda *a: packs.append(1) or real(*a)
        try:
            again = ops.linear_token_stats(hid, w, t, backend=backend, chunk_tokens=ct,
                                           chunk_vocab=cv)
        finally:
            cpp_backend.pack_linear = real
        assert not packs and torch.equal(again.logprob, out.logprob)
    compare(out, *logit_refs(hid, w, t))
