"""Model loading: the embedded default from the cache, equality with the GGUF original, clear
errors for missing models, 8-bit loading via bitsandbytes on the CPU."""

import pytest
import torch

from icqs_fast.models import cache_dir, embedded_gguf_path, embedded_model_dir, load_model

PROMPTS = ["The capital of France is", "Sentence: a charming film\nAnswer:"]


@pytest.fixture(scope="module")
def embedded():
    folder = embedded_model_dir()  # converts once if the cache is empty
    stamp = (folder / ".complete").stat().st_mtime_ns
    model, tok = load_model(device="cpu", dtype="float32")  # compared with fp32 below
    return folder, stamp, model, tok


def _logits(model, tok, text: str) -> torch.Tensor:
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def test_embedded_loads_from_cache(embedded):
    folder, stamp, model, tok = embedded
    assert folder.parent == cache_dir()
    assert (folder / "config.json").is_file()
    # A second lookup reuses the converted folder instead of converting again.
    assert embedded_model_dir() == folder
    assert (folder / ".complete").stat().st_mtime_ns == stamp
    assert model.config.model_type == "llama" and not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tok.pad_token_id is not None
    assert model.config.vocab_size >= len(tok)


def test_embedded_logits_equal_gguf(embedded):
    from transformers import AutoModelForCausalLM

    _, _, model, tok = embedded
    gguf = embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                               dtype=torch.float32).eval()
    # The converted weights are the GGUF's (bit for bit); the logits differ only by the order of
    # the fp32 sums (load_model's batch-invariant linear layers, not the library GEMM's).
    ours = model.state_dict()  # the weights the switched layers hold packed included
    for name, p in ref.named_parameters():
        assert torch.equal(ours[name], p), name
    for text in PROMPTS:
        torch.testing.assert_close(_logits(model, tok, text), _logits(ref, tok, text),
                                   atol=2e-4, rtol=1e-4)


def test_missing_models_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder, a GGUF file, a "
                       "packaged model .* nor a cached hub id"):
        load_model("no-such-model-icqs-test")
    with pytest.raises(FileNotFoundError, match="cannot load model no-org/no-such-model: not "
                       "found in local files") as exc:
        load_model("no-org/no-such-model")
    assert "\n" not in str(exc.value)
    with pytest.raises(FileNotFoundError, match="cannot load model .*: the folder has no "
                       "config.json"):
        load_model(tmp_path)  # an existing but empty folder


def test_load_8bit_on_cpu(embedded):
    import bitsandbytes as bnb

    _, _, model, tok = embedded
    q, qtok = load_model(load_in_8bit=True, device="cpu")
    lin = q.model.layers[0].self_attn.q_proj
    assert isinstance(lin, bnb.nn.Linear8bitLt) and lin.weight.dtype == torch.int8
    a, b = _logits(model, tok, PROMPTS[0]), _logits(q, qtok, PROMPTS[0])
    # 8-bit weights: close to the fp32 model, not equal; same (right) greedy next token.
    assert int(a[-1].argmax()) == int(b[-1].argmax())
    assert tok.decode(int(b[-1].argmax())).strip() == "Paris"
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert float(cos) > 0.99


def test_load_4bit_on_cpu(embedded):
    import bitsandbytes as bnb

    _, _, model, tok = embedded
    q, qtok = load_model(load_in_4bit=True, device="cpu")
    lin = q.model.layers[0].self_attn.q_proj
    assert isinstance(lin, bnb.nn.Linear4bit)
    a, b = _logits(model, tok, PROMPTS[0]), _logits(q, qtok, PROMPTS[0])
    # 4-bit weights: further from the fp32 model than 8-bit, still the right next token.
    assert tok.decode(int(b[-1].argmax())).strip() == "Paris"
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert float(cos) > 0.85  # measured 0.89


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ICQS_FAST_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("ICQS_FAST_CACHE", "~/x")
    assert cache_dir() == cache_dir().home() / "x"
    monkeypatch.delenv("ICQS_FAST_CACHE")
    assert cache_dir() == cache_dir().home() / ".cache" / "icqs_fast"


def test_bad_options():
    with pytest.raises(ValueError, match="at most one of load_in_8bit and load_in_4bit"):
        load_model(load_in_8bit=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(dtype="float7")
