"""cpp backend specifics: its block reduction against the float64 torch one on edge cases the
shared tests do not reach, thread-count invariance, and the kernels benchmark's JSON."""

import json

import pytest
import torch
from _helpers import isa_param

from icqs_fast.backends import cpp_backend, state

pytestmark = pytest.mark.skipif(not cpp_backend.available()[0],
                                reason=f"cpp backend unavailable: {cpp_backend.available()[1]}")


@pytest.fixture(params=[isa_param(name) for name in ("sse4", "avx2", "avx512")])
def isa(request, monkeypatch):
    """Run the test on every kernel ISA level this CPU can execute (SSE4.2, AVX2, AVX-512),
    forced through the ``ICQS_FAST_CPP_ISA`` setting: an AVX-512 machine runs the AVX2 path
    an AVX2-only machine takes by default."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, request.param)
    return request.param


def ref_block(z, t_local, z_t, shift, temperature):
    """The torch block reduction, in float64 (the definition of the state)."""
    return state.reduce_block(z.double(), t_local, z_t, shift, temperature)


def check_block(z, t_local, z_t, shift, temperature=1.0, rtol=2e-6):
    st, cnt = cpp_backend.reduce_block(z, t_local, z_t, shift, temperature)
    rst, rcnt = ref_block(z, t_local, z_t, shift, temperature)
    assert torch.equal(cnt, rcnt), f"counts {cnt.tolist()} != {rcnt.tolist()}"
    # m and n exactly, the sums to fp32-rounding accuracy relative to their natural scale:
    # s0 for the s sums, sqrt(n * u2) for u1 (its terms cancel), u2 for u2.
    assert torch.equal(st[:, 0], rst[:, 0])
    assert torch.equal(st[:, 4], rst[:, 4])
    s0, u2 = rst[:, 1].abs(), rst[:, 6].abs()
    scales = {1: s0, 2: s0, 3: s0, 5: (rst[:, 4] * u2).sqrt(), 6: u2}
    for k, scale in scales.items():
        scale = scale + rst[:, k].abs() + 1.0
        err = (st[:, k] - rst[:, k]).abs()
        assert (err <= rtol * scale).all(), f"state[:, {k}] err {err.max():.3e}"


def test_available_reports_isa():
    ok, why = cpp_backend.available()
    assert ok and "lanes" in why


def test_isa_setting_forces_the_level(monkeypatch):
    """``ICQS_FAST_CPP_ISA`` picks the kernel level (case and spaces ignored) and ``available``
    (what ``icqs-fast info`` prints) names it; ``auto`` or unset is the CPU's best."""
    from icqs_fast import _C

    monkeypatch.delenv(cpp_backend.ISA_ENV, raising=False)
    assert cpp_backend.isa_setting() == -1
    monkeypatch.setenv(cpp_backend.ISA_ENV, " Auto ")
    assert cpp_backend.isa_setting() == -1
    monkeypatch.setenv(cpp_backend.ISA_ENV, "SSE4")
    assert cpp_backend.isa_setting() == 0
    ok, why = cpp_backend.available()
    assert ok and _C.isa_name(0) in why and cpp_backend.ISA_ENV in why


def test_isa_setting_rejects_bad_values(monkeypatch):
    """An unknown value, or a level above the CPU's, makes the backend unavailable with the
    reason (``auto`` then falls back to torch; asking for ``cpp`` fails naming the setting)."""
    import types

    from icqs_fast import backends

    monkeypatch.setenv(cpp_backend.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="ICQS_FAST_CPP_ISA='avx1024' is not one of auto"):
        cpp_backend.isa_setting()
    ok, why = cpp_backend.available()
    assert not ok and "avx1024" in why
    assert backends.resolve("auto", torch.device("cpu")) != "cpp"
    with pytest.raises(RuntimeError, match="ICQS_FAST_CPP_ISA"):
        backends.resolve("cpp", torch.device("cpu"))
    # An AVX2-only CPU asked for AVX-512 (the extension seen as on such a CPU).
    avx2_cpu = types.SimpleNamespace(best_isa=lambda: 1, simd_level=lambda: "x86-64-v3")
    monkeypatch.setattr(cpp_backend, "_C", avx2_cpu)
    monkeypatch.setenv(cpp_backend.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="avx512: this CPU runs at most x86-64-v3"):
        cpp_backend.isa_setting()
    monkeypatch.setenv(cpp_backend.ISA_ENV, "avx2")
    assert cpp_backend.isa_setting() == 1


def test_bad_per_row_inputs_are_rejected():
    z = torch.randn(4, 100)
    t = torch.zeros(4, dtype=torch.long)
    zt = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"z_t must be a CPU tensor of shape \[4\]"):
        cpp_backend.reduce_block(z, t, zt[:3], zt, 1.0)
    with pytest.raises(ValueError, match="targets"):
        cpp_backend.reduce_block(z, t[:, None], zt, zt, 1.0)
    with pytest.raises(ValueError, match="CPU tensors"):
        cpp_backend.reduce_block(z.to("meta"), t, zt, zt, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_token_stats_every_isa(isa, dtype):
    """Whole-row mode on each ISA level, against the float64 reference."""
    from test_token_stats import compare, refs

    from icqs_fast import ops

    z = (torch.randn(7, 5000) * 4).to(dtype)
    z[1, ::5] = float("-inf")
    t = torch.randint(0, 5000, (7,))
    t[2] = -100
    compare(ops.token_stats(z, t, temperature=0.8, backend="cpp"), *refs(z, t, temperature=0.8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_multi_block_rows_with_growing_max(dtype, isa):
    """Rows longer than the 2048-element block whose max grows block after block (rescaling),
    V not a multiple of the 16-lane vector, temperature != 1."""
    n, v = 5, 2048 * 3 + 37
    z = torch.randn(n, v) * 3 + torch.linspace(0, 30, v)[None, :]
    z = z.to(dtype)
    t = torch.randint(0, v, (n,))
    z_t = z.double().gather(1, t[:, None])[:, 0]
    shift = z_t / 0.7
    check_block(z, t, z_t, shift, temperature=0.7)


def test_targets_outside_block_and_unrepresentable_z_t(isa):
    """Chunked mode: the target may lie before/after the block, and z_t need not be a float
    (it comes from a different product), so ">" and "==" must be exact against float64."""
    n, v = 6, 3000
    z = torch.randn(n, v)
    z[:, 100] = 0.25
    z[:, 2500] = 0.25
    t = torch.tensor([-5, v + 10, 2500, 100, 2999, 0])
    z_t = torch.tensor([0.25, 0.25, 0.25, 0.25 + 1e-12, 0.25 - 1e-12, float(z[5, 0])],
                       dtype=torch.float64)
    check_block(z, t, z_t, torch.zeros(n, dtype=torch.float64))


def test_non_finite_entries(isa):
    """NaN and +-inf are not finite: left out of max, sums and counts of finite entries; the
    rank comparisons follow IEEE (NaN never compares, +inf is greater than any z_t)."""
    n, v = 4, 4099
    z = torch.randn(n, v) * 2
    z[0, ::7] = float("nan")
    z[1, 5] = float("inf")
    z[1, 9] = float("-inf")
    z[2, :] = float("-inf")  # nothing finite: m = -inf, sums 0
    z[3, 4000:] = float("nan")
    t = torch.tensor([3, 100, 10, 4050])
    z_t = torch.tensor([float(z[0, 3]), float(z[1, 100]), float("-inf"), 0.0],
                       dtype=torch.float64)
    shift = torch.tensor([float(z[0, 3]), 1.0, 0.0, 0.0], dtype=torch.float64)
    check_block(z, t, z_t, shift)


def test_fp16_specials_convert_exactly(isa):
    """The kernel's own fp16 -> fp32 conversion: subnormals, zero, -0, max, inf."""
    vals = torch.tensor([6e-8, -6e-8, 1e-5, 0.0, -0.0, 65504.0, -65504.0, 1.0, -2.5, float("inf")])
    z = vals.half().repeat(2, 5)
    z[1, -1] = float("nan")
    t = torch.tensor([7, 2])
    z_t = z.double().gather(1, t[:, None])[:, 0]
    check_block(z, t, z_t, z_t.clone(), temperature=1000.0)


def test_large_offset_shift_precision(isa):
    """u sums relative to a shift far from the logits (the target at the tail of the row)."""
    n, v = 3, 49152
    z = torch.randn(n, v) * 4 + 1000
    t = z.argmin(-1)
    z_t = z.double().gather(1, t[:, None])[:, 0]
    st, _ = cpp_backend.reduce_block(z, t, z_t, z_t.clone(), 1.0)
    rst, _ = ref_block(z, t, z_t, z_t.clone(), 1.0)
    nn = rst[:, 4]
    var = (st[:, 6] - st[:, 5] ** 2 / nn) / (nn - 1)
    rvar = (rst[:, 6] - rst[:, 5] ** 2 / nn) / (nn - 1)
    assert torch.allclose(var, rvar, rtol=1e-5), (var, rvar)


def test_strided_rows_and_thread_count_invariance(isa):
    big = torch.randn(9, 5000)
    z = big[:, 3:4003]  # row stride 5000
    t = torch.randint(0, 4000, (9,))
    z_t = z.double().gather(1, t[:, None])[:, 0]
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = cpp_backend.reduce_block(z, t, z_t, z_t.clone(), 1.0)
        torch.set_num_threads(2)
        b = cpp_backend.reduce_block(z, t, z_t, z_t.clone(), 1.0)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    check_block(z, t, z_t, z_t.clone())


@pytest.mark.slow
def test_bench_kernels_quick_json(capsys, tmp_path):
    from icqs_fast import cli

    out = tmp_path / "k.json"
    rc = cli.main(["bench", "kernels", "--json", "--quick", "--repeat", "1", "--no-cuda",
                   "--out", str(out)])
    assert rc == 0
    records = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == records
    from icqs_fast.benchmarks.kernels import FIELDS

    seen = set()
    for r in records:
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        for key in ("time_ms", "baseline_ms", "speedup"):
            assert isinstance(r[key], float), (key, r)
        # Against a float64 reference: a wrong field or a dropped row is off by >> 1e-3.
        assert r["max_abs_err"] < 1e-3, r
        assert r["int_fields_exact"] or r["op"] == "linear_token_stats", r
        assert (r["gbps"] is None) == (r["op"] == "linear_token_stats"), r
        seen.add((r["op"], r["backend"], r["dtype"]))
    assert {("token_stats", "cpp", "fp32"), ("token_stats", "cpp", "bf16"),
            ("token_stats", "torch", "fp32"), ("linear_token_stats", "cpp", "fp32")} <= seen


def test_bench_kernels_record_arithmetic(monkeypatch):
    """With the timer replaced by known medians (2 ms ours, 5 ms baseline), the record holds
    them with ``speedup = baseline / ours`` and ``gbps`` = logits bytes read once per run."""
    from icqs_fast.benchmarks import kernels

    monkeypatch.setattr(kernels, "side_by_side", lambda a, b, repeat, device: (2.0, 5.0))
    rec = kernels.bench_token_stats("cpp", torch.device("cpu"), "fp32", 1000, 1000, 1, {})
    assert (rec["time_ms"], rec["baseline_ms"], rec["speedup"]) == (2.0, 5.0, 2.5)
    assert rec["gbps"] == 2.0  # 4e6 bytes in 2 ms
    assert rec["shape"] == [1000, 1000] and rec["max_abs_err"] < 1e-4
