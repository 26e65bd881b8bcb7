"""``ops.concat_slots`` (the cascade's per-row key runs): the C++ copy against the torch
reference on random runs, strided sources and every dtype; bad indices refused before a copy."""

from __future__ import annotations

import pytest
import torch

from icqs_fast import ops


def _random_parts(g: torch.Generator, r: int, h: int, d: int, dtype: torch.dtype):
    parts, width = [], torch.zeros(r, dtype=torch.long)
    for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
        n, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,),
                                                                              generator=g))
        # Some sources strided over their slots (a slice of a longer buffer, or [N, T, H, D]
        # transposed, as the projections' keys are).
        if torch.rand(1, generator=g) < 0.5:
            src = torch.randn(n, t, h, d, generator=g).to(dtype).transpose(1, 2)
        else:
            src = torch.randn(n, h, t + 3, d, generator=g).to(dtype)[:, :, 2:t + 2]
        rows = torch.randint(0, n, (r,), generator=g)
        starts = torch.randint(0, t, (r,), generator=g)
        counts = (torch.rand(r, generator=g) * (t - starts + 1)).long().clamp(max=t - starts)
        parts.append((src, rows, starts, counts))
        width += counts
    return parts, (int(width.max()) if r else 0) + 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpp_equals_the_reference(dtype):
    g = torch.Generator().manual_seed(11)
    for r, h, d in [(1, 1, 1), (5, 3, 64), (17, 2, 7), (0, 2, 4)]:
        parts, width = _random_parts(g, r, h, d, dtype)
        got = ops.concat_slots(parts, width, backend="cpp")
        want = ops.concat_slots(parts, width, backend="torch")
        assert got.shape == (r, h, width, d) and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, want)


def test_runs_land_back_to_back_then_zeros():
    a = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).view(2, 1, 4, 2)
    b = -torch.arange(1 * 1 * 3 * 2, dtype=torch.float32).view(1, 1, 3, 2) - 1
    ix = lambda *v: torch.tensor(v)  # noqa: E731
    out = ops.concat_slots([(a, ix(1), ix(2), ix(2)), (b, ix(0), ix(1), ix(1))], 5)
    assert out[0, 0].tolist() == [[12, 13], [14, 15], [-3, -4], [0, 0], [0, 0]]


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_bad_indices_are_refused_before_any_copy(backend):
    src = torch.randn(2, 1, 4, 3)
    ix = lambda *v: torch.tensor(v)  # noqa: E731
    for rows, starts, counts, match in [(ix(2), ix(0), ix(1), "part 0, row 0: source row 2 of 2"),
                                        (ix(0), ix(3), ix(2), r"slots \[3, 5\) of 4"),
                                        (ix(-1), ix(0), ix(1), "source row -1")]:
        with pytest.raises(IndexError, match=match):
            ops.concat_slots([(src, rows, starts, counts)], 4, backend=backend)
    with pytest.raises(IndexError, match="width 3"):
        ops.concat_slots([(src, ix(0), ix(0), ix(4))], 3, backend=backend)


def test_mismatched_parts_are_refused():
    ix = lambda *v: torch.tensor(v)  # noqa: E731
    a, one = torch.zeros(1, 2, 3, 4), (ix(0), ix(0), ix(1))
    with pytest.raises(ValueError, match=r"part 1: src must be \[N, 2, T, 4\]"):
        ops.concat_slots([(a, *one), (torch.zeros(1, 3, 3, 4), *one)], 4)
    with pytest.raises(TypeError, match="part 1"):
        ops.concat_slots([(a, *one), (a.double(), *one)], 4)
    with pytest.raises(ValueError, match=r"\[2\] int64"):
        ops.concat_slots([(a, ix(0, 0), ix(0), ix(1))], 4)
    with pytest.raises(ValueError, match="at least one part"):
        ops.concat_slots([], 4)
