"""--quantization {none,int8,nf4} (issue 49, item 1): declared once, on score, features, serve,
eval and lm-eval's model args, in the resume fingerprint; without CUDA a clear exit-2 message
naming CUDA; an 8-bit model computes in fp16 on CUDA; a quantised LM head keeps the fused head
path (its dense copy, made once) instead of dropping to the plain forward."""

import io
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from _helpers import tiny_llama, write_jsonl

from icqs_fast.cli import main
from icqs_fast.engine import capability
from icqs_fast.models import quantization_kwargs
from icqs_fast.options import QUANTIZATIONS


def _help(cmd: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main([*cmd, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("cmd", [["score"], ["features"], ["serve"], ["eval", "fpb"]])
def test_the_flag_is_listed(cmd):
    assert "--quantization {none,int8,nf4}" in _help(cmd)


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


@pytest.mark.parametrize("q", ["int8", "nf4"])
def test_without_cuda_the_flag_exits_2_naming_cuda(tmp_path, q, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    demos = [{"x": "a", "y": "positive"}, {"x": "b", "y": "negative"}]
    g, b = write_jsonl(tmp_path / "g.jsonl", demos), write_jsonl(tmp_path / "b.jsonl", demos)
    inp = write_jsonl(tmp_path / "in.jsonl", demos)
    out = tmp_path / "o.jsonl"
    for argv in (["score", str(inp), "-o", str(out), "--good", str(g), "--bad", str(b)],
                 ["features", str(inp), "-o", str(out)],
                 ["serve"], ["eval", "fpb"]):
        rc, err = _run([*argv, "--quantization", q])
        assert rc == 2, (argv, err)
        assert f"--quantization {q} (bitsandbytes) needs a CUDA device" in err, (argv, err)
        assert "Traceback" not in err
    assert not out.exists()  # refused before any output is touched


def test_lm_eval_model_args_take_it(monkeypatch):
    pytest.importorskip("lm_eval")
    from icqs_fast.compat.lm_eval import ICQSFastLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--quantization nf4 .* needs a CUDA device"):
        ICQSFastLM(pretrained="embedded", quantization="nf4", device="cpu")


def test_names_and_kwargs(monkeypatch):
    assert QUANTIZATIONS == ("none", "int8", "nf4")
    assert quantization_kwargs("none", "cpu") == {"load_in_8bit": False, "load_in_4bit": False}
    assert quantization_kwargs("int8", "cuda") == {"load_in_8bit": True, "load_in_4bit": False}
    assert quantization_kwargs("nf4", "cuda:1") == {"load_in_8bit": False, "load_in_4bit": True}
    with pytest.raises(ValueError, match="must be one of none, int8, nf4"):
        quantization_kwargs("int4", "cuda")


def test_it_is_in_the_fingerprint(tmp_path):
    from icqs_fast.jobs.config import FeatureJobConfig, ScoreJobConfig

    g = write_jsonl(tmp_path / "g.jsonl", [{"x": "a", "y": "b"}])
    kw = dict(input="-", output="o.jsonl", good=str(g), bad=str(g))
    plain = ScoreJobConfig(**kw).resume_key()
    q8 = ScoreJobConfig(**kw, quantization="int8").resume_key()
    assert "quantization" not in plain and q8 == {**plain, "quantization": "int8"}
    f = FeatureJobConfig(input="-", output="o.jsonl", quantization="nf4").resume_key()
    assert f["quantization"] == "nf4"
    with pytest.raises(ValueError, match="--quantization must be one of"):
        ScoreJobConfig(**kw, quantization="q4")


def test_8bit_computes_in_fp16_on_cuda(tmp_path, tiny_llama_dir, monkeypatch):
    """bitsandbytes' int8 CUDA matmul casts other activations to fp16 at every call (and warns
    each time): the load asks transformers for fp16 and says why."""
    import transformers

    from icqs_fast import models

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def fake(path, **kw):  # records what load_model asks for; loads on the CPU, unquantised
        seen.update(kw)
        return real(path, dtype=kw["dtype"])

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    model, _ = models.load_model(tiny_llama_dir(), device="cuda", load_in_8bit=True)
    assert seen["dtype"] == torch.float16 and seen["quantization_config"].load_in_8bit
    choice = models.dtype_choice_of(model)
    assert choice.dtype == torch.float16 and "LLM.int8" in choice.reason
    seen.clear()
    models.load_model(tiny_llama_dir(), device="cuda", load_in_4bit=True)
    assert seen["dtype"] == torch.bfloat16  # NF4 computes in the chosen dtype


def _quantised_head(kind: str):
    import bitsandbytes as bnb

    model, _ = tiny_llama(device="cpu")
    w = model.lm_head.weight.data.clone()
    if kind == "nf4":
        head = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False,
                                 compute_dtype=torch.bfloat16, quant_type="nf4")
        head.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
    else:
        head = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=False, has_fp16_weights=False)
        head.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    model.lm_head = head.to("cpu")  # quantises the weight
    return model


@pytest.mark.slow  # a tiny model per kind, its plan's probes (~4 s each here)
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantised_head_keeps_the_fused_path(kind):
    """Before, the head probe read the packed weight (a 4-bit head's ``[V H / 2, 1]`` bytes) and
    the model dropped to the plain forward, scored from its own logits."""
    pytest.importorskip("bitsandbytes")
    model = _quantised_head(kind)
    assert type(model.lm_head.weight).__name__ in ("Params4bit", "Int8Params")
    plan = capability.model_plan(model)
    assert plan.path == "cascade" and not plan.own_logits, plan.message
    dense = capability.dense_head_weight(model.lm_head)
    assert dense.shape == (model.config.vocab_size, model.config.hidden_size)
    assert capability.dense_head_weight(model.lm_head) is dense  # made once
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        hidden = model.model(input_ids=ids).last_hidden_state[0]
    got = plan.head_stats(hidden, ids[0], backend="torch").logprob
    want = torch.log_softmax(logits, -1).gather(1, ids[0][:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=3e-3, rtol=0)


def test_declared_once():
    from icqs_fast.jobs.config import JobConfig
    from icqs_fast.options import declaration

    d = declaration(JobConfig, "quantization")
    assert d.flag == "--quantization" and tuple(d.option.choices) == QUANTIZATIONS
    assert not hasattr(JobConfig, "load_in_8bit")
