"""The engine's distance to the limit (icqs_fast.benchmarks.roofline): FLOP counts equal to the
arithmetic of known shapes (integers, exact), the head counted apart from the decoder's linears,
the probe's and the fields' arithmetic, and the time profile adding up. No timing is asserted
beyond being positive."""

from __future__ import annotations

import pytest
import torch

from bench.studies import engine_profile
from icqs_fast import ops
from icqs_fast.benchmarks import roofline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _linear_params(body) -> int:
    return sum(m.in_features * m.out_features for m in body.modules()
               if isinstance(m, torch.nn.Linear))


def test_body_forward_flops_match_the_shapes(tiny_llama_model):
    model, _ = tiny_llama_model
    if next(model.parameters()).device.type != "cpu":
        pytest.skip("the attention count is of the CPU sdpa kernel")
    cfg = model.config
    b, t = 3, 17
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        count, _ = roofline.count_flops(lambda: model.model(input_ids=ids))
    assert count.linear == 2 * b * t * _linear_params(model.model)
    d = cfg.hidden_size // cfg.num_attention_heads
    # Scores and values per layer over the full T x T rectangle (sdpa on the CPU).
    assert count.attention == cfg.num_hidden_layers * 4 * b * cfg.num_attention_heads * t * t * d
    assert count.head == 0
    # Every projection and MLP weight shape, with the rows of each call.
    assert {kn for kn in count.linear_rows} == {
        (m.in_features, m.out_features) for m in model.model.modules()
        if isinstance(m, torch.nn.Linear)}
    assert all(rows == [b * t] * len(rows) for rows in count.linear_rows.values())


def test_packed_linears_are_counted_as_linears(tiny_llama_dir):
    """A bf16-mixed model's prepacked decoder linears (``mkldnn::_linear_pointwise``) count as
    the plain ones did."""
    from icqs_fast import invariant_linears, models

    model, _ = models.load_model(tiny_llama_dir(layers=2), dtype="bf16-mixed", device="cpu")
    if not any(invariant_linears.uses_packed_weights(m) for m in model.modules()):
        pytest.skip("nothing packed on this CPU")
    b, t = 2, 11
    ids = torch.randint(0, model.config.vocab_size, (b, t),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        count, _ = roofline.count_flops(lambda: model.model(input_ids=ids))
    assert count.linear == 2 * b * t * _linear_params(model.model)
    assert all(rows == [b * t] * len(rows) for rows in count.linear_rows.values())


def test_head_statistics_count_as_head():
    n, h, v = 5, 16, 40
    g = torch.Generator().manual_seed(0)
    hidden, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    count, _ = roofline.count_flops(
        lambda: ops.linear_token_stats(hidden, w, targets, backend="torch"))
    assert count.head == 2 * n * h * v and count.linear == 0 and count.attention == 0
    assert count.as_dict()["model_gflop"] == round(2 * n * h * v / 1e9, 3)


def test_weighted_median_rows():
    assert roofline.weighted_median_rows({}) == 0
    # 1 call of 100 rows on a big weight outweighs 3 calls of 10 rows on a small one.
    assert roofline.weighted_median_rows({(8, 8): [10, 10, 10], (64, 64): [100]}) == 100
    assert roofline.weighted_median_rows({(8, 8): [10, 10, 10], (8, 9): [20]}) == 10


def test_limit_fields_arithmetic():
    c = roofline.FlopCount(linear=6 * 10**9, attention=10**9, head=10**9)
    c.linear_rows[(4, 4)].append(8)
    probes = [{"limit_gflops": 10.0, "limit_gflops_cpu": 12.0, "probe_rows": 8,
               "probe_shapes": []},
              {"limit_gflops": 16.0, "limit_gflops_cpu": 14.0, "probe_rows": 8,
               "probe_shapes": [{"k": 4, "n": 4, "share": 1.0, "gflops": 16.0}]}]
    f = roofline.limit_fields(c, wall_s=1.0, cpu_s=0.5, probes=probes)
    assert f["model_gflop"] == 8.0 and f["linear_gflop"] == 6.0
    assert f["achieved_gflops"] == 8.0 and f["achieved_linear_gflops"] == 6.0
    assert f["limit_gflops"] == 16.0 and f["limit_probes_gflops"] == [10.0, 16.0]
    assert f["fraction_of_limit"] == 0.5
    assert f["achieved_gflops_cpu"] == 16.0 and f["limit_gflops_cpu"] == 14.0
    assert f["fraction_of_limit_cpu"] == round(16 / 14, 3)
    none = roofline.limit_fields(c, 1.0, None, [{"limit_gflops": None}])
    assert none["limit_gflops"] is None and none["fraction_of_limit"] is None


def test_probe_times_each_counted_shape():
    c = roofline.FlopCount()
    c.linear_rows[(32, 64)] += [16, 16]
    c.linear_rows[(64, 32)] += [16]
    p = roofline.matmul_probe(c, torch.float32, seconds=0.01)
    assert p["probe_rows"] == 16
    assert {(s["k"], s["n"]) for s in p["probe_shapes"]} == {(32, 64), (64, 32)}
    assert sum(s["share"] for s in p["probe_shapes"]) == pytest.approx(1.0, abs=1e-3)
    assert p["limit_gflops"] > 0 and p["limit_gflops_cpu"] > 0
    empty = roofline.matmul_probe(roofline.FlopCount(), torch.float32)
    assert empty["limit_gflops"] is None


def test_module_times_add_up(tiny_llama_model):
    model, _ = tiny_llama_model
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device=model.device)
    with torch.no_grad():
        rows, _ = engine_profile.module_times(lambda: model(input_ids=ids), model)
    total = rows.pop("total (wall)")
    assert total > 0 and sum(rows.values()) == pytest.approx(total, rel=1e-9)
    assert rows["linear layers (matmuls)"] > 0 and rows["norms"] > 0
    assert ops.linear_token_stats.__name__ == "linear_token_stats"  # restored
