"""``--dtype auto`` on the CPU (icqs_fast.models.choose_dtype): bf16-mixed where the CPU has native
bf16 dot products, float32 where it has not, both branches with the capability patched; the
override variable; the once-per-process warning for an explicit slow dtype; and the same choice,
with its reason, reaching load_model, runtime_settings (the run's meta file), the CLI, the
lm-eval model and ``info``.

The suite pins the choice to float32 (tests/_helpers.py sets ``$ICQS_FAST_CPU_DTYPE``); these
tests unset it.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _helpers import write_jsonl

from icqs_fast import models

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NATIVE = (True, "native bf16 dot products (avx512_bf16)")
NOT_NATIVE = (False, "no native bf16 dot product (neither avx512_bf16 nor AMX)")


@pytest.fixture
def detect(monkeypatch):
    """Unset the suite's pin and the warned-once memory; returns a setter for the capability."""
    monkeypatch.delenv(models.CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr(models, "_WARNED", set())

    def set_native(native: bool, fp16: bool = False) -> None:
        monkeypatch.setattr(models, "cpu_bf16_support", lambda: NATIVE if native else NOT_NATIVE)
        monkeypatch.setattr(models, "cpu_fp16_support", lambda: fp16)

    return set_native


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir()


def test_auto_picks_bf16_products_with_native_bf16(detect):
    detect(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the automatic choice must not warn
        c = models.choose_dtype("auto", "cpu")
    # bf16-products: fp32 activations and parameters holding bf16 weights, bf16 products.
    assert c.dtype == torch.float32 and c.mixed and c.bf16_products and c.requested == "auto"
    assert c.name == models.FAST_NAME == "bf16-products"
    assert "native bf16" in c.reason and "avx512_bf16" in c.reason
    assert c.as_dict() == {"dtype": "bf16-products", "dtype_requested": "auto",
                           "dtype_reason": c.reason}
    # An explicit bfloat16 stays the pure bf16 forward; bf16-mixed is a CPU mode.
    assert not models.choose_dtype("bfloat16", "cpu").mixed
    mixed = models.choose_dtype("mixed", "cpu")
    assert mixed.mixed and not mixed.bf16_products and mixed.name == "bf16-mixed"
    assert models.choose_dtype("bf16-products", "cpu").name == "bf16-products"
    with pytest.raises(ValueError, match="CPU mode"):
        models.choose_dtype("bf16-mixed", "cuda")


def test_auto_picks_float32_without_native_bf16(detect):
    detect(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = models.choose_dtype("auto", "cpu")
    assert c.dtype == torch.float32 and "no native bf16" in c.reason


def test_auto_on_cuda_is_bf16_whatever_the_cpu(detect):
    detect(False)
    assert models.choose_dtype("auto", "cuda").dtype == torch.bfloat16


def test_override_variable(detect, monkeypatch):
    detect(True)
    monkeypatch.setenv(models.CPU_DTYPE_ENV, "float32")
    c = models.choose_dtype("auto", "cpu")
    assert c.dtype == torch.float32 and models.CPU_DTYPE_ENV in c.reason
    # An explicit dtype wins over the variable.
    assert models.choose_dtype("bf16", "cpu").dtype == torch.bfloat16
    monkeypatch.setenv(models.CPU_DTYPE_ENV, "int3")
    with pytest.raises(ValueError, match=r"unknown dtype 'int3' in \$ICQS_FAST_CPU_DTYPE"):
        models.choose_dtype("auto", "cpu")


def test_explicit_slow_dtype_warns_once(detect):
    detect(False)
    with pytest.warns(RuntimeWarning, match=r"bfloat16 on this CPU.*5\.5x slower than float32"
                                            r".*--dtype float32"):
        c = models.choose_dtype("bfloat16", "cpu")
    assert c.dtype == torch.bfloat16 and c.reason == "requested (bfloat16)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.choose_dtype("bf16", "cpu")  # once per process: no second warning
        models.choose_dtype("float32", "cpu")
        models.choose_dtype("bf16", "cuda")  # not a CPU
    with pytest.warns(RuntimeWarning, match="float16 on this CPU"):
        models.choose_dtype("fp16", "cpu")


def test_explicit_bf16_with_native_support_does_not_warn(detect):
    detect(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.choose_dtype("bfloat16", "cpu").dtype == torch.bfloat16


def test_unknown_dtype_name():
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        models.choose_dtype("float7", "cpu")


def test_detection_reads_torch_and_needs_onednn(monkeypatch):
    """cpu_bf16_support itself (uncached) with torch's answers patched: an x86 CPU with
    avx512_bf16 or AMX is native; AVX-512 alone is not; oneDNN switched off is not."""
    import platform

    detect = models.cpu_bf16_support.__wrapped__
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for var in models.ONEDNN_ISA_ENVS:  # a run emulating an AVX2-only CPU sets one
        monkeypatch.delenv(var, raising=False)
    for avx, amx, want in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        native, why = detect()
        assert native is want, (avx, amx, why)
        assert ("avx512_bf16" in why) is avx or not want
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    native, why = detect()
    assert not native and "oneDNN" in why


def test_onednn_capped_below_bf16_is_not_native(monkeypatch):
    """oneDNN's ISA cap (how an AVX2-only CPU is emulated on this one) below its bf16 kernels
    makes bf16 not native, naming the variable; a cap at or above them, or none, does not."""
    import platform

    detect = models.cpu_bf16_support.__wrapped__
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    for var in models.ONEDNN_ISA_ENVS:
        monkeypatch.delenv(var, raising=False)
    assert detect()[0]
    for value, want in (("avx2", False), ("AVX512_CORE", False), ("avx512_core_bf16", True),
                        ("AVX512_CORE_AMX", True), ("ALL", True)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", value)
        native, why = detect()
        assert native is want, (value, why)
        if not want:
            assert f"ONEDNN_MAX_CPU_ISA={value.upper()}" in why
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert detect() == (False, "DNNL_MAX_CPU_ISA=AVX2 caps oneDNN below its bf16 dot products")


def test_cli_dtype_names_match_models():
    from icqs_fast.cli.options import DTYPE_NAMES

    # The CLI may also offer bf16-mixed and bf16-products by name (models.MIXED_NAMES, FAST_NAMES).
    assert (set(DTYPE_NAMES) - set(models.MIXED_NAMES) - set(models.FAST_NAMES)
            == {"auto"} | set(models.DTYPE_NAMES))


@pytest.mark.parametrize("native", [True, False])
def test_load_model_and_runtime_settings_take_the_choice(detect, tiny_dir, native):
    detect(native)
    model, _ = models.load_model(tiny_dir, device="cpu")
    assert next(model.parameters()).dtype == torch.float32
    assert models.is_bf16_mixed(model) is native
    rt = models.runtime_settings(model, "auto")
    assert rt["dtype"] == ("bf16-products" if native else "float32")
    assert rt["dtype_reason"] == models.choose_dtype("auto", "cpu").reason
    assert models.dtype_choice_of(model).mixed is native
    # A model changed after loading reports its own dtype, said as such.
    model.to(torch.bfloat16)
    assert models.runtime_settings(model, "auto")["dtype"] == "bfloat16"
    assert "not chosen" in models.runtime_settings(model, "auto")["dtype_reason"]


def test_score_meta_and_lm_eval_model_take_the_same_choice(detect, tiny_dir, tmp_path):
    """`score` with the default dtype writes the chosen dtype and its reason to the meta file;
    the lm-eval model built by name loads the same dtype."""
    from icqs_fast.cli import main
    from icqs_fast.compat.lm_eval import ICQSFastLM

    detect(True)
    good = write_jsonl(tmp_path / "good.jsonl", [{"x": f"g{i}", "y": "positive"} for i in range(3)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"x": f"b{i}", "y": "negative"} for i in range(3)])
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": "How was it?", "y": "Fine."}])
    out = tmp_path / "out.jsonl"
    argv = ["score", str(inp), "-o", str(out), "--good", str(good), "--bad", str(bad),
            "--model", str(tiny_dir), "--num-ratios", "2",
            "--demos-per-set", "1", "--sets-per-ratio", "1", "--quiet"]
    assert main(argv) == 0
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["dtype"] == "bf16-products"
    assert meta["dtype_reason"] == models.choose_dtype("auto", "cpu").reason
    lm = ICQSFastLM(pretrained=str(tiny_dir), device="cpu")
    assert models.dtype_name(lm.model) == "bf16-products"


def test_info_shows_the_choice(detect):
    from icqs_fast.info import collect

    detect(False)
    info = collect()
    assert info["auto_dtype_cpu"] == "float32"
    assert "no native bf16" in info["auto_dtype_cpu_reason"]
    assert info["cpu_native_bf16"] is False


def test_precision_bench_answers_are_held_out_and_balanced():
    """The side-by-side precision benchmark's answers: SST-2 sentences outside the
    demonstration pools, correct and incorrect labels alternating."""
    from bench.studies import precision
    from icqs_fast.io.datasets import shared_data_dir

    if not (shared_data_dir() / "sst2" / "dev.tsv").is_file():
        pytest.skip("SST-2 data not found under ../shared/data/sst2")
    good, bad, resp = precision.answers(6)
    assert len(good) == len(bad) == 32 and len(resp) == 6
    pools = {x for x, _ in good + bad}
    assert not pools & {x for x, _ in resp}
    for (x1, y1), (x2, y2) in zip(resp[::2], resp[1::2], strict=True):
        assert x1 == x2 and {y1, y2} == {"positive", "negative"}


def test_auto_resumes_in_the_outputs_own_dtype(detect, tiny_dir, tmp_path):
    """An output written in float32 (before `auto` chose bf16 here, or on another CPU kind)
    resumes with the default dtype in float32, instead of being refused for its dtype; an
    explicit other dtype is still refused."""
    from icqs_fast.cli import main
    from icqs_fast.io.runs import OutputPolicy, resumed_dtype

    good = write_jsonl(tmp_path / "good.jsonl", [{"x": f"g{i}", "y": "positive"} for i in range(3)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"x": f"b{i}", "y": "negative"} for i in range(3)])
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": f"q{i}", "y": "Fine."} for i in range(3)])
    out = tmp_path / "out.jsonl"
    argv = ["score", str(inp), "-o", str(out), "--good", str(good), "--bad", str(bad),
            "--model", str(tiny_dir), "--num-ratios", "2", "--demos-per-set", "1",
            "--sets-per-ratio", "1", "--quiet"]
    detect(False)  # written where auto is float32
    assert main(argv) == 0
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    detect(True)  # resumed where auto is bf16
    assert main([*argv, "--resume"]) == 0
    assert len(out.read_text().splitlines()) == 3
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["dtype"] == "float32"
    assert main([*argv, "--resume", "--dtype", "bfloat16"]) == 2  # asked for: refused
    # The rule itself: only "auto" follows the output; a new run decides for itself.
    old = OutputPolicy(out, append=True, old={"dtype": "float32"})
    assert resumed_dtype(old, "auto") == "float32" and resumed_dtype(old, "bf16") == "bf16"
    assert resumed_dtype(OutputPolicy(out, old={"dtype": "float32"}), "auto") == "auto"


def test_precision_bench_fails_when_the_default_misses_its_promises():
    """The precision benchmark's exit code: its stored record's ``auto`` keeps the default's
    promises; a record whose ``auto`` misses stability, batch invariance or the float32
    distance is named, each once."""
    import copy
    import json
    from pathlib import Path

    from bench.studies import precision

    rec = json.loads((Path(__file__).parents[1] / "bench/results/precision_cpu.json").read_text())
    assert precision.default_failures(rec) == []
    assert precision.default_failures({"variants": {"float32": {}}}) == []
    for field, value, words in (("passes_stability", False, "scores within"),
                                ("echo_alone_vs_request_max_per_token", 0.2, "inside a request"),
                                ("echo_vs_fp32_max_per_token", 0.3, "from float32")):
        bad = copy.deepcopy(rec)
        bad["variants"]["auto"][field] = value
        got = precision.default_failures(bad)
        assert len(got) == 1 and words in got[0], got
