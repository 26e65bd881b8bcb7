"""The fused LM head compiles a few times per model, not once per N (issue 49, item 5): TILES
followed N (31 values over N = 1..16,384 for a 4096-wide model) and Triton specialised N on
N == 1 and N % 16, ~3 s per sm_90 compile, paid again in every Ray actor. Now N is not
specialised and TILES is one of at most three counts up to 16,384 rows. The count is of
the distinct compile keys (signature, constexprs, 16-divisibility, warps, stages) of the
launches the launcher issues, as :mod:`bench.gpu_model.fake_cuda` derives them."""

import pytest
import torch
from icqs_fast.kernels import linear_token_stats as k

from bench.gpu_model.compiler import compile_key
from bench.gpu_model.launches import linear_token_stats as kl

SHAPES = [(4096, 32000), (4096, 151936), (2048, 49152), (576, 49152)]
# Every class Triton's specialisation tells apart (N == 1, N % 16 == 0, the rest), the bounds
# of the range and a spread between them (the whole range: the slow test below).
SAMPLE_N = sorted({1, 2, 15, 16, 17, 31, 32, 127, 128, 129, 1000, 1024, 4096, 16383, 16384,
                   *range(3, 16385, 97)})


def _keys(h: int, v: int, dtype: torch.dtype, ns) -> tuple[set, set, set]:
    main, target, tiles = set(), set(), set()
    for n in ns:
        t, m = kl.gpu_launches(n, h, v, dtype)
        main.add(compile_key(m, "sm_90"))
        target.add(compile_key(t, "sm_90"))
        tiles.add(m.constexprs["TILES"])
    return main, target, tiles


@pytest.mark.parametrize("h,v", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_at_most_four_compiles_over_n(h, v, dtype):
    main, target, tiles = _keys(h, v, dtype, SAMPLE_N)
    assert len(main) + len(target) <= 4, (len(main), len(target), sorted(tiles))
    assert len(target) == 1 and len(main) == len(tiles)  # N itself makes no variant


@pytest.mark.slow  # 16,384 launch descriptions (~8 s here)
def test_at_most_four_compiles_over_every_n():
    main, target, tiles = _keys(4096, 32000, torch.bfloat16, range(1, 16385))
    assert len(main) + len(target) <= 4, sorted(tiles)  # 63 before (31 TILES x N's classes)


def _jit(fn):
    """The kernel as the JIT sees it (under the interpreter, its JITFunction from the same
    declaration: the interpreter keeps the arguments, not the parameters)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    return JITFunction(fn.fn, do_not_specialize=fn.kwargs["do_not_specialize"])


def test_the_launch_is_described_as_the_jit_specialises_it():
    """The unspecialised N is neither a constexpr at 1 nor 16-divisible, in the static
    description and in the fake GPU's derivation from the kernel's own parameters."""
    from bench.gpu_model.fake_cuda import launch_of

    kernel = _jit(k._linear_token_stats_kernel)
    params = {p.name: p for p in kernel.params}
    assert params["N"].do_not_specialize and not params["V"].do_not_specialize
    _, m = kl.gpu_launches(1, 64, 256, torch.bfloat16)
    assert m.signature["N"] == "i32" and "N" not in m.constexprs
    assert "N" not in m.extra["divisible_by_16"]
    _, m16 = kl.gpu_launches(32, 64, 256, torch.bfloat16)
    assert "N" not in m16.extra["divisible_by_16"] and "V" in m16.extra["divisible_by_16"]
    for n in (1, 32):
        args = [torch.empty(1)] * 8 + [n, 256, 64, 64, 1, 64, 1, 1.0, None]
        launch, _ = launch_of(kernel, tuple(args), {}, (1, 1, 1))
        assert launch.signature["N"] == "i32" and "N" not in launch.constexprs
        assert "N" not in launch.extra["divisible_by_16"] and "V" in launch.extra[
            "divisible_by_16"]
