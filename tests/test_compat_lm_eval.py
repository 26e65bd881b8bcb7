"""The ``icqs-fast`` lm-eval model against lm-eval's own Hugging Face model (``HFLM``) on the
same model object: every (loglik, is_greedy) through the LM API, rolling log-likelihoods,
generation, ``simple_evaluate`` end to end on a local SST-2 task, registration, and the
``bench lm-eval`` record."""

import json

import pytest
import torch
from _helpers import skip_unless_in_ci
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from icqs_fast.compat.lm_eval import ICQSFastLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4  # fp32, per request


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_llama_dir(layers=2)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, model, AutoTokenizer.from_pretrained(d)


def _pair(tiny, **kw):
    """HFLM and ours on the same model and tokenizer objects (kw: shared model args)."""
    _, model, tok = tiny
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=3, device="cpu", **kw)
    return hf, ICQSFastLM(model=model, tokenizer=tok, chunk_size=4, **kw)


def _inst(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, ((la, ga), (lb, gb)) in enumerate(zip(a, b, strict=True)):
        assert abs(la - lb) <= TOL, (i, la, lb)
        assert ga == gb, (i, ga, gb)


def test_loglikelihood_equals_hflm(tiny):
    hf, ours = _pair(tiny)
    q = "Question: which planet is the largest in the solar system?\nAnswer:"
    reqs = [
        (q, " Jupiter"), (q, " Saturn"), (q, " the planet Jupiter, by far"),  # shared context
        (q + " It is", " Jupiter"),  # context extending another one
        ("Review: a charming film\nSentiment:", " positive"),  # one-token continuations
        ("Review: a charming film\nSentiment:", " negative"),
        ("Review: dull\nSentiment: ", "negative"),  # trailing space moves to the continuation
        ("", "An empty context is scored after BOS"),  # HFLM: prefix token as the context
        ("x", " y"),  # one-token context
    ]
    a = hf.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True)
    _assert_same(a, ours.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True))
    # Small banks and forwards: contexts split over several banks, rows over several batches.
    _, model, tok = tiny
    small = ICQSFastLM(model=model, tokenizer=tok, max_bank_tokens=8, token_budget=16)
    _assert_same(a, small.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True))
    assert small.requests_scored == len(reqs)


def test_bos_adding_tokenizer_equals_hflm(tiny):
    """A tokenizer that prepends BOS (as Llama's and Gemma's do): every context starts with it,
    a string that already starts with the BOS text gets no second one, and add_bos_token=False
    turns it off - on both sides alike."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    d, model, _ = tiny
    tok = AutoTokenizer.from_pretrained(d)
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.bos_token_id)])
    assert tok.encode("Hello")[0] == tok.bos_token_id  # the test tokenizer does add BOS
    reqs = [("Review: great\nSentiment:", " positive"), ("Review: great\nSentiment:", " negative"),
            (bos + "Already has BOS:", " yes"), ("", "Empty context")]
    for add_bos in (None, False):
        hf = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu",
                  add_bos_token=add_bos)
        ours = ICQSFastLM(model=model, tokenizer=tok, add_bos_token=add_bos)
        _assert_same(hf.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True),
                     ours.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True))
        assert (ours.tok_encode(reqs[0][0])[0] == tok.bos_token_id) == (add_bos is None)


def test_greedy_and_truncated_tokens_equal_hflm(tiny):
    """Token-level requests: continuations made of the model's own argmax tokens (is_greedy
    True, also with one token changed: False), and requests longer than max_length (HFLM
    drops context tokens from the left)."""
    _, model, tok = tiny
    hf, ours = _pair(tiny, max_length=40)
    ctx = tok.encode("The model continues this text with its favourite tokens:")
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(ctx):]
    g = torch.Generator().manual_seed(0)
    long_ctx = torch.randint(3, 4000, (70,), generator=g).tolist()
    reqs = [(None, ctx, greedy), (None, ctx, greedy[:1]), (None, ctx[:5], greedy),
            (None, ctx, greedy[:2] + [greedy[2] + 1] + greedy[3:]),
            (None, long_ctx, [11, 12, 13]), (None, long_ctx[:45], [21]),
            (None, long_ctx[:-1], long_ctx[-1:])]
    a = hf._loglikelihood_tokens(reqs, disable_tqdm=True)
    b = ours._loglikelihood_tokens(reqs, disable_tqdm=True)
    _assert_same(a, b)
    assert b[0][1] and b[1][1] and not b[3][1]  # the checks above can see is_greedy


def test_rolling_equals_hflm(tiny):
    # max_length 32: the longer strings span several windows.
    hf, ours = _pair(tiny, max_length=32)
    texts = ["one short line",
             "A longer text that the rolling windows have to cut into several pieces, each "
             "scored with one token of the previous window as context, until the end.",
             "Second text: " + "lorem ipsum dolor sit amet " * 6]
    a = hf.loglikelihood_rolling(_inst("loglikelihood_rolling", [(t,) for t in texts]),
                                 disable_tqdm=True)
    b = ours.loglikelihood_rolling(_inst("loglikelihood_rolling", [(t,) for t in texts]),
                                   disable_tqdm=True)
    assert len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= TOL, (x, y)


def test_generate_until_equals_hflm(tiny):
    hf, ours = _pair(tiny)
    reqs = [("Once upon a time", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}),
            ("Hello", {"until": ["the"], "max_gen_toks": 5})]
    a = hf.generate_until(_inst("generate_until", reqs), disable_tqdm=True)
    b = ours.generate_until(_inst("generate_until", reqs), disable_tqdm=True)
    assert a == b and all(isinstance(s, str) for s in b)


def test_chat_template_equals_hflm(tiny):
    hf, ours = _pair(tiny)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(chat, gen) == hf.apply_chat_template(chat, gen)
    assert "Hi?" in ours.apply_chat_template(chat)


def test_bad_inputs(tiny):
    _, model, tok = tiny
    with pytest.raises(ValueError, match="both model= and tokenizer="):
        ICQSFastLM(model=model)
    if not torch.cuda.is_available():  # lm-eval's CLI passes device cuda:0 by default
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert ICQSFastLM(model=model, tokenizer=tok, device="cuda:0").device.type == "cpu"
    ours = ICQSFastLM(model=model, tokenizer=tok)
    with pytest.raises(ValueError, match="request 1: empty"):
        ours._loglikelihood_tokens([(None, [1, 2], [3]), (None, [1, 2], [])])
    with pytest.raises(ValueError, match="max_length"):
        ICQSFastLM(model=model, tokenizer=tok, max_length=8)._loglikelihood_tokens(
            [(None, [1], list(range(3, 13)))])


def test_registered_and_cli(tiny, monkeypatch):
    """``icqs-fast`` resolves through lm-eval's registry (and the built-in ``hf`` still does),
    loads from model_args like lm-eval's CLI builds it, and ``main`` hands lm-eval's CLI its
    arguments with the model registered."""
    import sys

    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from icqs_fast.compat import lm_eval as compat

    assert get_model("icqs-fast") is ICQSFastLM
    assert get_model("hf") is HFLM
    d, model, tok = tiny
    lm = get_model("icqs-fast").create_from_arg_string(
        f"pretrained={d},dtype=float32", {"batch_size": 1, "max_batch_size": None,
                                          "device": "cpu"})
    req = _inst("loglikelihood", [("Review: fine\nSentiment:", " positive")])
    hf, _ = _pair(tiny)
    _assert_same(hf.loglikelihood(req, disable_tqdm=True), lm.loglikelihood(req, disable_tqdm=True))

    seen = {}

    def fake_cli():
        seen["argv"] = sys.argv[1:]
        seen["model"] = get_model("icqs-fast")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fake_cli)
    monkeypatch.setattr(sys, "argv", ["prog"])
    assert compat.main(["--model", "icqs-fast", "--tasks", "x"]) == 0
    assert seen == {"argv": ["--model", "icqs-fast", "--tasks", "x"], "model": ICQSFastLM}


def _sst2_rows():
    from icqs_fast.benchmarks.lm_eval import read_sst2
    from icqs_fast.io.datasets import shared_data_dir

    path = shared_data_dir() / "sst2" / "dev.tsv"
    if not path.is_file():
        skip_unless_in_ci(f"SST-2 data not found at {path}")
    return read_sst2(path)


@pytest.mark.slow
def test_simple_evaluate_equals_hflm(tiny, tmp_path):
    """End to end: lm_eval.simple_evaluate on a local 3-shot first_n SST-2 task (YAML over
    JSONL), ours and HFLM: the same accuracy and per-sample (loglik, is_greedy)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from icqs_fast.benchmarks.lm_eval import write_sst2_task

    task = write_sst2_task(tmp_path, _sst2_rows(), shots=3)
    hf, ours = _pair(tiny)
    out = [lm_eval.simple_evaluate(
        model=lm, tasks=[task], limit=5, bootstrap_iters=0, log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
        for lm in (hf, ours)]
    res = [o["results"][task]["acc,none"] for o in out]
    assert res[0] == res[1]
    samples = [sorted(o["samples"][task], key=lambda s: s["doc_id"]) for o in out]
    assert [s["doc_id"] for s in samples[0]] == list(range(5))
    for sa, sb in zip(*samples, strict=True):
        assert sa["arguments"] == sb["arguments"]
        # The few-shot context is the first 3 pool rows for every document (first_n).
        assert sa["arguments"][0][0].startswith("Review: ")
        assert sa["arguments"][0][0].count("Sentiment:") == 4
        _assert_same([r[0] for r in sa["resps"]], [r[0] for r in sb["resps"]])
    # The numbers are the model's: one request against a plain full forward.
    _, model, tok = tiny
    ctx, cont = samples[1][0]["arguments"][1]
    ci, wi = tok.encode(ctx), tok.encode(ctx + cont)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([wi])).logits[0].double(), -1)
    ref = sum(float(lp[t - 1, wi[t]]) for t in range(len(ci), len(wi)))
    assert abs(samples[1][0]["resps"][1][0][0] - ref) <= TOL


@pytest.mark.slow
def test_bench_record(tiny, capsys, monkeypatch):
    """``icqs-fast bench lm-eval --json`` on the tiny model: the record's fields and their
    relations (each document sends one request per choice; one-token continuations make one
    suffix token per request). Every shared prefix run kept (a forward costs no tokens): the
    tiny model's forwards cost so little that by default the bank recomputes the 3 documents'
    shared shots, and the record could not show that it computes fewer tokens than HF."""
    from icqs_fast.cli import main
    from icqs_fast.engine import batching

    monkeypatch.setattr(batching, "FORWARD_COST_TOKENS", (0, 0))

    rows = _sst2_rows()  # skips outside CI when the data is missing
    assert rows
    d, _, _ = tiny
    assert main(["bench", "lm-eval", "--json", "--model", str(d), "--limit", "3",
                 "--shots", "2"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["limit"] == 3 and rec["shots"] == 2 and rec["docs"] == 3
    assert rec["requests"] == rec["hf_requests"] == 6
    assert rec["max_abs_diff"] <= TOL and rec["is_greedy_agreement"] == 1.0
    assert rec["acc_hf"] == rec["acc_ours"] and rec["same_predictions"] is True
    assert rec["ours_suffix_tokens"] == 6
    assert 0 < rec["ours_prefix_tokens"] < rec["hf_tokens_real"] <= rec["hf_tokens_padded"]
    assert rec["ours_tokens"] == rec["ours_prefix_tokens"] + rec["ours_suffix_tokens"]
    assert rec["hf_s"] > 0 and rec["ours_s"] > 0 and rec["speedup"] > 0
    for key in ("hf_eval_s", "ours_eval_s", "token_ratio", "hf_forward_rows", "commit"):
        assert key in rec


@pytest.mark.slow
@pytest.mark.embedded
def test_embedded_model_equals_hflm():
    """The embedded SmolLM2-135M on a few requests, is_greedy True among them. Continuations
    of up to 4 tokens: within TOL of HFLM. A 9-token one: HFLM's own fp32 forward is ~1.4e-4
    off a float64 forward there (ours ~1e-5), so it must be no further from float64 than
    HFLM's."""
    import copy

    from icqs_fast.models import embedded_gguf_path, load_model

    try:
        embedded_gguf_path()
    except FileNotFoundError as exc:
        skip_unless_in_ci(str(exc))
    model, tok = load_model(None, dtype="float32", device="cpu")
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu")
    ours = ICQSFastLM(model=model, tokenizer=tok)
    q = "The capital of France is"
    reqs = [(q, " Paris"), (q, " Berlin"), ("1, 2, 3, 4,", " 5"),
            ("Review: a dull, tedious film\nSentiment:", " negative"), (q, " Paris, France"),
            (q, " Paris, and the capital of Italy is Rome")]
    a = hf.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True)
    b = ours.loglikelihood(_inst("loglikelihood", reqs), disable_tqdm=True)
    _assert_same(a[:-1], b[:-1])
    assert a[-1][1] == b[-1][1]
    assert any(g for _, g in b) and not all(g for _, g in b)
    # float64 reference of the long one: a plain forward of the whole text in a float64 copy
    ctx, cont = reqs[-1]
    ci, wi = tok.encode(ctx), tok.encode(ctx + cont)
    with torch.no_grad():
        lp = torch.log_softmax(copy.deepcopy(model).double()(torch.tensor([wi])).logits[0], -1)
    ref = sum(float(lp[t - 1, wi[t]]) for t in range(len(ci), len(wi)))
    assert abs(b[-1][0] - ref) <= abs(a[-1][0] - ref) + 1e-5, (a[-1][0], b[-1][0], ref)
