"""Ask LLM and ICL label against a plain full forward of the whole prompt (written out here:
the whole prompt text tokenised, one model forward, float64 log-softmax, the option tokens read
off), on a tiny random Llama and on the embedded model; and ICL's log-likelihoods equal to the
ICQS engine's for the same demonstrations (the ICL prompt is token for token an ICQS prompt)."""

import math

import pytest
import torch
from _helpers import skip_unless_in_ci

from icqs_fast.engine.prompts import Template
from icqs_fast.evals.baselines import ASK_LLM_TEMPLATE, ICLResult, ask_llm, icl_label, is_correct

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ITEMS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Name a prime number.", "Nine."),
    ("Summarise: the market fell.", "Stocks went down."),
]
DEMOS = [("Profit rose by 20 %.", "positive"), ("Sales fell sharply.", "negative"),
         ("The board met on Monday.", "neutral")]
XS = ["Operating loss widened.", "Revenue doubled year on year.", "The company is in Espoo."]
LABELS = ["positive", "negative", "neutral", "mixed feelings"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_llama_dir(layers=2)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    tok = AutoTokenizer.from_pretrained(d)
    return model, tok


@torch.no_grad()
def _next_logprobs(model, tok, text: str) -> torch.Tensor:
    """float64 log-probabilities of the token after the whole of ``text``."""
    ids = tok(text)["input_ids"]
    z = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return torch.log_softmax(z, -1)


@torch.no_grad()
def _loglik(model, tok, prompt: str, cont: str) -> tuple[float, int]:
    """log P(cont | prompt) and cont's token count: prompt + cont tokenised as one text, the
    tokens after the prompt's own tokens scored, one forward."""
    p = tok(prompt)["input_ids"]
    ids = tok(prompt + cont)["input_ids"]
    assert ids[: len(p)] == p  # the test texts do not merge tokens across the seam
    z = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(z, -1)
    return float(sum(lp[t - 1, ids[t]] for t in range(len(p), len(ids)))), len(ids) - len(p)


def _ref_ask(model, tok, x: str, y: str, chat: bool) -> tuple[list[float], float]:
    user = ASK_LLM_TEMPLATE.user.replace("{x}", x).replace("{y}", y)
    if chat:
        text = tok.apply_chat_template(
            [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    else:
        text = "You are a helpful assistant.\n\n" + user + "\n\n"
    lp = _next_logprobs(model, tok, text + "Rating: [[")
    ids = tok.convert_tokens_to_ids(["1", "2", "3", "4", "5"])
    p = lp[ids].exp()
    return (p / p.sum()).tolist(), float(p.sum())


def _check_ask(res, ref, tol=1e-4):
    probs, mass = ref
    assert res.probs == pytest.approx(probs, abs=tol)
    assert sum(res.probs) == pytest.approx(1.0, abs=1e-9)
    assert res.mass == pytest.approx(mass, rel=tol)
    # argmax and expectation from the reference's probabilities (a near-tie would be flaky).
    top = sorted(probs, reverse=True)
    if top[0] - top[1] > 10 * tol:
        assert res.rating_argmax == 1 + probs.index(top[0])
    assert res.rating_expected == pytest.approx(sum((k + 1) * p for k, p in enumerate(probs)),
                                                abs=5 * tol)


@pytest.mark.parametrize("chat", [True, False])
def test_ask_llm_matches_full_forward(tiny, chat):
    model, tok = tiny
    out = ask_llm(model, tok, ITEMS, chat=chat)
    assert [r.index for r in out] == [0, 1, 2]
    for (x, y), r in zip(ITEMS, out, strict=True):
        _check_ask(r, _ref_ask(model, tok, x, y, chat))
    # Different answers get different ratings distributions (the item reached the prompt).
    assert out[0].probs != pytest.approx(out[1].probs, abs=1e-6)


def _ref_icl(model, tok, demos, x, labels, template, length_normalize=False):
    prompt = template.format_prefix(demos) + template.format_query(x)
    both = {lab: _loglik(model, tok, prompt, template.format_response(lab)) for lab in labels}
    ll = {lab: v for lab, (v, _) in both.items()}
    n = {lab: k for lab, (_, k) in both.items()}
    sc = {lab: ll[lab] / n[lab] if length_normalize else ll[lab] for lab in labels}
    m = max(sc.values())
    z = sum(math.exp(v - m) for v in sc.values())
    return ll, {lab: math.exp(v - m) / z for lab, v in sc.items()}, n


@pytest.mark.parametrize("length_normalize", [False, True])
def test_icl_label_matches_full_forward(tiny, length_normalize):
    model, tok = tiny
    tpl = Template()
    out = icl_label(model, tok, DEMOS, XS, LABELS, length_normalize=length_normalize)
    for x, r in zip(XS, out, strict=True):
        ll, probs, n = _ref_icl(model, tok, DEMOS, x, LABELS, tpl, length_normalize)
        assert n["mixed feelings"] > n["positive"]  # a multi-token label is summed
        assert r.n_tokens == n
        for lab in LABELS:
            assert r.logliks[lab] == pytest.approx(ll[lab], abs=1e-4)
            assert r.probs[lab] == pytest.approx(probs[lab], abs=1e-4)
        assert r.label == max(LABELS, key=lambda lab: probs[lab])


def test_icl_equals_the_icqs_engine_on_the_same_demos(tiny):
    from icqs_fast.engine.scorer import ICQSScorer

    model, tok = tiny
    bad = [(x, {"positive": "negative", "negative": "positive", "neutral": "positive"}[y])
           for x, y in DEMOS]
    for tpl in (Template(), Template.from_chat_template(tok)):
        # M+1 = 2, N = all 3 good demos, L = 1: the r = 1 set holds the good pool, shuffled.
        sc = ICQSScorer(model, tok, DEMOS, bad, num_ratios=2, demos_per_set=3,
                        sets_per_ratio=1, template=tpl, seed=3)
        demos = sc.sets[1][0].examples
        for x in XS[:2]:
            icl = icl_label(model, tok, demos, [x], LABELS[:2], template=tpl)[0]
            for lab in LABELS[:2]:
                ll = float(sc.score_one(x, lab).loglik[1, 0])
                assert icl.logliks[lab] == pytest.approx(ll, abs=1e-4)


def test_icl_label_chat_template_and_items_as_pairs(tiny):
    model, tok = tiny
    tpl = Template.from_chat_template(tok, system="Label the sentiment.")
    items = [(x, "positive") for x in XS[:2]] + [{"x": XS[2], "y": "neutral"}]
    out = icl_label(model, tok, DEMOS[:2], items, LABELS[:3], template=tpl)
    for x, r in zip(XS, out, strict=True):
        ll, _, _ = _ref_icl(model, tok, DEMOS[:2], x, LABELS[:3], tpl)
        for lab in LABELS[:3]:
            assert r.logliks[lab] == pytest.approx(ll[lab], abs=1e-4)


def test_is_correct_and_bad_inputs(tiny):
    model, tok = tiny
    r = ICLResult(label="negative", logliks={}, probs={}, n_tokens={})
    assert is_correct(r, "negative") and is_correct(r, " negative\n")
    assert not is_correct(r, "positive") and not is_correct(r, "Negative")
    with pytest.raises(TypeError, match="labels must be a sequence"):
        icl_label(model, tok, DEMOS, XS, "positive")
    with pytest.raises(ValueError, match="at least two distinct"):
        icl_label(model, tok, DEMOS, XS, ["positive", "positive"])
    with pytest.raises(ValueError, match=r"labels\[1\] must be a non-empty str"):
        icl_label(model, tok, DEMOS, XS, ["positive", " "])
    with pytest.raises(TypeError, match=r"item 1: field 'x' must be a str"):
        icl_label(model, tok, DEMOS, ["a", (3, "b")], LABELS)
    with pytest.raises(TypeError, match=r"demos\[0\]"):
        icl_label(model, tok, ["not a pair"], XS, LABELS)
    with pytest.raises(ValueError, match=r"item 0: missing field\(s\) \['y'\]"):
        ask_llm(model, tok, [{"x": "q"}])
    with pytest.raises(ValueError, match=r"item 0: prompt of \d+ tokens exceeds"):
        ask_llm(model, tok, [("q " * 600, "a")])
    assert ask_llm(model, tok, []) == [] and icl_label(model, tok, DEMOS, [], LABELS) == []


@pytest.mark.embedded
def test_embedded_model_matches_full_forward():
    from icqs_fast import models

    try:
        models.embedded_gguf_path()
    except FileNotFoundError:
        skip_unless_in_ci("embedded model not available")
    model, tok = models.load_model(device="cpu", dtype="float32")
    out = ask_llm(model, tok, ITEMS[:2])
    for (x, y), r in zip(ITEMS[:2], out, strict=True):
        _check_ask(r, _ref_ask(model, tok, x, y, chat=True))
    # A real judge puts most of its next-token mass on the ratings.
    assert all(r.mass > 0.5 for r in out)
    tpl = Template(system="Sentiment of financial news.\n\n",
                   demo="Headline: {x}\nSentiment: {y}\n",
                   query="Headline: {x}\nSentiment:")
    res = icl_label(model, tok, DEMOS[:2], XS[:2], LABELS[:2], template=tpl)
    for x, r in zip(XS[:2], res, strict=True):
        ll, probs, _ = _ref_icl(model, tok, DEMOS[:2], x, LABELS[:2], tpl)
        for lab in LABELS[:2]:
            assert r.probs[lab] == pytest.approx(probs[lab], abs=1e-4)
            assert r.logliks[lab] == pytest.approx(ll[lab], abs=1e-3)


def test_command_line(tiny, tmp_path, capsys, monkeypatch):
    import json

    from icqs_fast import models
    from icqs_fast.evals import baselines

    model, tok = tiny
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, tok))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "x": x, "y": y}) + "\n"
                           for i, (x, y) in enumerate(ITEMS[:2])))
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"x": x, "y": y}) + "\n" for x, y in DEMOS))
    assert baselines.main(["ask-llm", str(inp)]) == 0
    rows = [json.loads(s) for s in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1"]
    for (x, y), r in zip(ITEMS[:2], rows, strict=True):
        assert r["probs"] == pytest.approx(_ref_ask(model, tok, x, y, True)[0], abs=1e-4)
    out = tmp_path / "out.jsonl"
    assert baselines.main(["icl", str(inp), "--demos", str(demos), "--labels",
                           "positive, negative", "-o", str(out)]) == 0
    rows = [json.loads(s) for s in out.read_text().splitlines()]
    for (x, _), r in zip(ITEMS[:2], rows, strict=True):
        ll, _, _ = _ref_icl(model, tok, DEMOS, x, ["positive", "negative"], Template())
        assert r["logliks"] == pytest.approx(ll, abs=1e-4)
    inp.write_text('{"x": "q"}\n')
    assert baselines.main(["ask-llm", str(inp)]) == 2
    assert "in.jsonl" in capsys.readouterr().err
