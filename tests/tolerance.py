"""flash-attention's rule for judging a kernel: its error against a float64 reference may be at
most ``factor`` times the error of the same torch code run in the kernel's output dtype, plus a
floor of a few ulps. The bound follows the dtype and the shape (a longer sum, a larger offset,
bf16 instead of fp32 all grow the torch code's error too) where a fixed tolerance is either too
loose for fp32 or too tight for bf16."""

import torch


def assert_within_torch_error(out: torch.Tensor, ref64: torch.Tensor,
                              torch_same_dtype: torch.Tensor, *, factor: float = 2.0,
                              ulps: float = 8.0, slack: torch.Tensor | float = 0.0,
                              name: str = "out") -> float:
    """Assert ``|out - ref64| <= factor * max|torch_same_dtype - ref64| + floor + slack``
    everywhere; return the largest bound used.

    ``out``: the kernel's result (any shape, any float dtype, any device); ``ref64``: the same
    quantity from the reference code in float64; ``torch_same_dtype``: that reference code run
    in the dtype the kernel writes (``torch_same_dtype.dtype`` picks the ulp), on the same
    inputs. All three of one shape. The floor, ``ulps`` ulps of that dtype at
    ``max(1, max|ref64|)``, exists because the torch code is sometimes exact (one key, a row of
    ties, a sum that happens to round right): its error is then 0, and a kernel that sums in
    another order must still pass with a few ulps. ``slack`` (a float, or a tensor broadcast to
    ``ref64``'s shape) is an allowance the caller names for a rounding the torch code does not
    make and the kernel documents (0 unless given). Where ``ref64`` is not finite, ``out`` must
    hold the same value (the same infinity, or NaN); elsewhere the torch code must be finite,
    or it would be no yardstick."""
    out, ref, pt = (x.detach().cpu().double() for x in (out, ref64, torch_same_dtype))
    assert out.shape == ref.shape == pt.shape, (name, out.shape, ref.shape, pt.shape)
    fin = torch.isfinite(ref)
    same_special = torch.where(torch.isnan(ref[~fin]), torch.isnan(out[~fin]),
                               out[~fin] == ref[~fin])
    assert bool(same_special.all()), (f"{name}: where the reference is not finite the kernel "
                                      f"gave {out[~fin][~same_special].tolist()[:5]}")
    assert bool(torch.isfinite(pt[fin]).all()), (
        f"{name}: the torch code in {torch_same_dtype.dtype} is not finite where the float64 "
        "reference is: it cannot bound the kernel here")
    if not bool(fin.any()):
        return 0.0
    err = (out[fin] - ref[fin]).abs()
    torch_err = float((pt[fin] - ref[fin]).abs().max())
    floor = ulps * torch.finfo(torch_same_dtype.dtype).eps * max(1.0, float(ref[fin].abs().max()))
    slack = torch.as_tensor(slack, dtype=torch.float64).cpu().expand_as(ref)[fin]
    bound = factor * torch_err + floor + slack
    over = err - bound
    worst = int(over.argmax())
    if float(over[worst]) > 0 or not bool(torch.isfinite(err).all()):
        where = fin.nonzero()[worst].tolist()
        raise AssertionError(
            f"{name}: kernel error {float(err[worst]):.3e} at {where} (kernel "
            f"{float(out[fin][worst]):.9g}, float64 {float(ref[fin][worst]):.9g}) > bound "
            f"{float(bound[worst]):.3e} = {factor} x torch-in-{torch_same_dtype.dtype} error "
            f"{torch_err:.3e} + floor {floor:.3e} + slack {float(slack[worst]):.3e}")
    return float(bound.max())
