"""Glass-box features vs a plain float64 reference (full log_softmax, eager attentions), batching
invariance, the SelfEval-compat formulas, ensembles, reference augmentation and the MT-Bench
evaluation on a few real answers."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from _helpers import DEVICE, skip_unless_in_ci

from icqs_fast.features.attention import eager_range_entropy
from icqs_fast.features.ensembles import decoding_ensemble, default_system_prompts, prompt_ensemble
from icqs_fast.features.extract import (
    ALL_FEATURES,
    FEATURE_DIRECTION,
    as_item,
    calibrate,
    encode,
    glassbox,
    illustrate,
    selfeval_formulas,
)
from icqs_fast.models import embedded_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mtbench"

ITEMS = [
    ("What is the capital of France?", "The capital of France is Paris.", "Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof\nwhispers to the sleeping town\n"
     "puddles hold the sky", None),
    {"instruction": "And now in French?", "response": "La capitale de la France est Paris.",
     "history": [("What is the capital of France?", "Paris.")]},
    ("Say hi", "Hi!"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def tiny(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=len(tokenizer),
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(DEVICE).eval()


@pytest.fixture(scope="module")
def embedded():
    from icqs_fast.models import load_model

    return load_model(None, dtype="float32")


def reference_features(model, tokenizer, items, f64=True, **enc_kw):
    """Unpadded, one item at a time: full log_softmax (float64) + eager attentions."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    if f64:
        ref = ref.double()
    out = []
    for it in items:
        e = encode(tokenizer, as_item(it), **enc_kw)
        ids = torch.tensor([e.ids], device=DEVICE)
        p, n = e.prompt_len, len(e.ids)
        with torch.no_grad():
            o = ref(ids, output_attentions=True, use_cache=False)
        lsm = torch.log_softmax(o.logits[0].double(), -1)[p - 1:n - 1]
        prob = lsm.exp()
        lp = lsm.gather(-1, ids[0, p:, None])[:, 0]
        qm = torch.zeros(1, n, dtype=torch.bool, device=DEVICE)
        qm[0, p:] = True
        kr = torch.tensor([e.instr], device=DEVICE)
        ent = torch.stack([eager_range_entropy(a.double(), kr, qm)[0] for a in o.attentions])
        per_head = ent[:, :, p:].double().mean(-1)
        out.append({
            "n_tokens": n - p,
            "sent_logprob": lp.mean().item(),
            "softmax_ent": (-(prob * lsm).sum(-1)).mean().item(),
            "softmax_var": lsm.var(-1).mean().item(),
            "token_prob_var": lp.exp().var(unbiased=False).item(),
            "attn_ent_avg": per_head.mean().item(),
            "attn_ent_min": per_head.min().item(),
        })
        # Per item: entropy over its range [0, log V], variance in units of (log V)^2.
        lv = math.log(o.logits.shape[-1])
        out[-1]["softmax_combo"] = (out[-1]["softmax_ent"] / lv
                                    + out[-1]["softmax_var"] / lv**2) / 2
    return out


NO_COMBO = tuple(k for k in ALL_FEATURES if k != "softmax_combo")


def _check_combo(got, vocab):
    """softmax_combo = (softmax_ent / log V + softmax_var / (log V)^2) / 2 of each item's own
    returned entropy and variance (the intrinsic ComboScale; nothing from the other items)."""
    lv = math.log(vocab)
    for r in got:
        want = (r["softmax_ent"] / lv + r["softmax_var"] / lv**2) / 2
        assert r["softmax_combo"] == pytest.approx(want, rel=1e-12, abs=1e-15)


def _close(got, want, atol, rtol=0.0, keys=NO_COMBO):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["n_tokens"] == w["n_tokens"]
        for k in keys:
            assert g[k] == pytest.approx(w[k], abs=atol, rel=rtol), k


def test_tiny_matches_float64_reference(tiny, tokenizer):
    got = glassbox(tiny, tokenizer, ITEMS, batch_size=3, backend="torch")
    _close(got, reference_features(tiny, tokenizer, ITEMS), atol=1e-4, rtol=1e-5,
           keys=ALL_FEATURES)
    _check_combo(got, len(tokenizer))
    got_auto = glassbox(tiny, tokenizer, ITEMS, batch_size=3)
    _close(got_auto, got, atol=1e-4, rtol=1e-5)


def test_batching_and_padding_invariance(tiny, tokenizer):
    one = glassbox(tiny, tokenizer, ITEMS, batch_size=1)
    three = glassbox(tiny, tokenizer, ITEMS, batch_size=3)
    _close(three, one, atol=2e-5, rtol=1e-5, keys=ALL_FEATURES)
    _check_combo(three, len(tokenizer))
    # Order of the results is the input order.
    rev = glassbox(tiny, tokenizer, ITEMS[::-1], batch_size=3)
    _close(rev[::-1], three, atol=2e-5, rtol=1e-5)


def test_plain_template_and_instruction_span(tiny, tokenizer):
    it = as_item(ITEMS[2])
    for chat in (True, False):
        e = encode(tokenizer, it, use_chat_template=chat)
        assert tokenizer.decode(e.ids[e.instr[0]:e.instr[1]]) == it.instruction
        assert tokenizer.decode(e.ids[e.prompt_len:]) == it.response
    got = glassbox(tiny, tokenizer, ITEMS, use_chat_template=False)
    _close(got, reference_features(tiny, tokenizer, ITEMS, use_chat_template=False), atol=1e-4,
           rtol=1e-5)


def test_empty_response_is_nan_and_bad_args(tiny, tokenizer):
    r = glassbox(tiny, tokenizer, [("Say hi", "")] + ITEMS[:1])
    assert r[0]["n_tokens"] == 0 and all(math.isnan(r[0][k]) for k in ALL_FEATURES)
    assert math.isfinite(r[1]["sent_logprob"])
    with pytest.raises(ValueError, match="unknown feature"):
        glassbox(tiny, tokenizer, ITEMS, features=["nope"])
    with pytest.raises(ValueError, match="mode"):
        glassbox(tiny, tokenizer, ITEMS, mode="x")
    with pytest.raises(TypeError):
        glassbox(tiny, tokenizer, [42])
    assert set(FEATURE_DIRECTION) >= set(ALL_FEATURES)


def _selfeval_direct(logits, ids, p):
    """The SelfEval code's formulas (``get_single_evaluation``, modes logprobs /
    logprobs-entropy / logprobs-variance), followed literally in float64 with explicit loops:
    every position of the row is visited, positions ``t < p`` (the instruction) contribute 0, the
    target of position ``t`` is the id rolled left by one (``ids[(t + 1) % L]``: the last position
    wraps around to ``ids[0]``), and the sums are divided by ``target_len = L - p``. The vocabulary
    "entropy" divides by the vocabulary size (the original's constant 32000 is Llama-2's).
    ``token_prob_var`` has no counterpart in the original; ours is the unbiased variance of
    ``p(y_t)`` over the usual window."""
    logits = logits.double().cpu()
    ids = ids.cpu()
    n, v = logits.shape
    target_len = n - p
    lp_sum = ent_sum = var_sum = 0.0
    for t in range(n):
        if t < p:  # instruction masking: log-probs set to 0
            continue
        z = logits[t]
        ls = z - torch.logsumexp(z, 0)
        lp_sum += ls[ids[(t + 1) % n]].item()
        ent_sum += ((ls * z).sum() / v).item()
        var_sum += (((ls - ls.mean()) ** 2).sum() / (v - 1)).item()
    pr = []
    for t in range(p, n):  # our token_prob_var: logits[t-1] scores ids[t]
        z = logits[t - 1]
        pr.append(math.exp((z[ids[t]] - torch.logsumexp(z, 0)).item()))
    mean = sum(pr) / len(pr)
    tpv = sum((x - mean) ** 2 for x in pr) / (len(pr) - 1) if len(pr) > 1 else math.nan
    return {"sent_logprob": lp_sum / target_len, "softmax_ent": ent_sum / target_len,
            "softmax_var": var_sum / target_len, "token_prob_var": tpv}


def test_selfeval_formulas_direct():
    torch.manual_seed(0)
    logits = torch.randn(12, 50, dtype=torch.float64) * 3
    ids = torch.randint(0, 50, (12,))
    for p in (1, 5, 10):
        got = selfeval_formulas(logits, ids, p)
        want = _selfeval_direct(logits, ids, p)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-10, abs=1e-12), (p, k)
    # The wrap-around: the last position is scored at ids[0], and the first response token's own
    # prediction (logits[p-1]) does not enter sent_logprob.
    ids2 = ids.clone()
    ids2[0] = (ids[0] + 1) % 50
    lsm = torch.log_softmax(logits[-1], -1)
    d = selfeval_formulas(logits, ids2, 5)["sent_logprob"] - selfeval_formulas(logits, ids, 5)[
        "sent_logprob"]
    assert d == pytest.approx((lsm[ids2[0]] - lsm[ids[0]]).item() / 7, rel=1e-10)
    moved = logits.clone()
    moved[4] = torch.randn(50, dtype=torch.float64)
    assert selfeval_formulas(moved, ids, 5)["sent_logprob"] == pytest.approx(
        selfeval_formulas(logits, ids, 5)["sent_logprob"], rel=1e-12)
    # One response token: the only term is the wrap-around one.
    one = selfeval_formulas(logits, ids, 11)
    assert one["sent_logprob"] == pytest.approx(lsm[ids[0]].item(), rel=1e-12)
    assert math.isnan(one["token_prob_var"])
    with pytest.raises(ValueError):
        selfeval_formulas(logits, ids, 12)


def test_compat_mode_matches_direct(tiny, tokenizer):
    got = glassbox(tiny, tokenizer, ITEMS, mode="selfeval-compat", batch_size=3)
    keys = ("sent_logprob", "softmax_ent", "softmax_var", "token_prob_var")
    for it, g in zip(ITEMS, got, strict=True):
        e = encode(tokenizer, as_item(it))
        ids = torch.tensor(e.ids, device=DEVICE)
        with torch.no_grad():
            logits = tiny(ids[None]).logits[0]
        want = _selfeval_direct(logits, ids, e.prompt_len)
        for k in keys:
            assert g[k] == pytest.approx(want[k], abs=1e-4, rel=1e-4), k
    # The compat "entropy" is a different quantity from the standard one.
    std = glassbox(tiny, tokenizer, ITEMS, features=["softmax_ent"])
    assert got[0]["softmax_ent"] != pytest.approx(std[0]["softmax_ent"], rel=1e-2)
    # Attention features are the same in both modes.
    for g, s in zip(got, glassbox(tiny, tokenizer, ITEMS), strict=True):
        assert g["attn_ent_avg"] == pytest.approx(s["attn_ent_avg"], abs=1e-5)


def test_prompt_ensemble(tiny, tokenizer):
    pool = default_system_prompts()
    assert len(pool) == 7 and len(set(pool)) == 7
    res = prompt_ensemble(tiny, tokenizer, ITEMS[:2], system_prompts=pool[:3], batch_size=4)
    assert len(res) == 2
    for it, r in zip(ITEMS[:2], res, strict=True):
        per = [math.exp(glassbox(tiny, tokenizer, [it], features=["sent_logprob"],
                                 system_prompt=sp)[0]["sent_logprob"]) for sp in pool[:3]]
        assert r["members"] == pytest.approx(per, rel=1e-5)
        mean = sum(per) / 3
        assert r["unt_exp"] == pytest.approx(mean, rel=1e-5)
        assert r["unt_var"] == pytest.approx(sum((p - mean) ** 2 for p in per) / 3, rel=1e-4,
                                             abs=1e-12)
    assert len(prompt_ensemble(tiny, tokenizer, ITEMS[:1])[0]["members"]) == 7


def _count_forwards(model):
    """Forward hook on the decoder body: the batch size of every forward, in order."""
    from icqs_fast.engine.batching import decoder_body

    rows = []

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows.append(int(ids.shape[0]))

    return rows, decoder_body(model).register_forward_hook(hook, with_kwargs=True)


def test_prompt_ensemble_one_forward_per_item(tiny, tokenizer):
    """The 7 members of an item (same response, different system prompts) share one forward,
    and the values equal scoring each member on its own."""
    pool = default_system_prompts()
    items = ITEMS[:3]
    rows, h = _count_forwards(tiny)
    try:
        res = prompt_ensemble(tiny, tokenizer, items)
        assert rows == [7, 7, 7]  # one forward per item, all 7 members in it
        rows.clear()
        res2 = prompt_ensemble(tiny, tokenizer, items, batch_size=2)
        assert rows == [14, 7]  # batch_size counts items; members are never split
    finally:
        h.remove()
    for it, r, r2 in zip(items, res, res2, strict=True):
        per = [math.exp(glassbox(tiny, tokenizer, [it], features=["sent_logprob"],
                                 system_prompt=sp, batch_size=1)[0]["sent_logprob"])
               for sp in pool]
        assert r["members"] == pytest.approx(per, rel=1e-5)
        assert r2["members"] == pytest.approx(per, rel=1e-5)
        mean = sum(per) / 7
        assert r["unt_exp"] == pytest.approx(mean, rel=1e-5)
        assert r["unt_var"] == pytest.approx(sum((p - mean) ** 2 for p in per) / 7, rel=1e-3,
                                             abs=1e-12)
    with pytest.raises(ValueError, match="batch_size"):
        prompt_ensemble(tiny, tokenizer, items, batch_size=0)


def test_prompt_ensemble_reference_calibration(tiny, tokenizer):
    """calibrate: unt_exp / unt_var of the answer minus factor x the same ensemble value of the
    reference answer scored as the response; items without a reference keep the plain values."""
    pool = default_system_prompts()[:3]
    items = ITEMS[:2]  # the first has a reference, the second not
    plain = prompt_ensemble(tiny, tokenizer, items, system_prompts=pool)
    it = as_item(items[0])
    ref = prompt_ensemble(tiny, tokenizer, [(it.instruction, it.reference)], system_prompts=pool)[0]
    cal = prompt_ensemble(tiny, tokenizer, items, system_prompts=pool, reference="calibrate",
                          calibration_factor=0.5)
    for k in ("unt_exp", "unt_var"):
        assert cal[0][k] == pytest.approx(plain[0][k] - 0.5 * ref[k], rel=1e-4, abs=1e-9), k
        assert cal[1][k] == pytest.approx(plain[1][k], rel=1e-5, abs=1e-12), k
    assert cal[0]["members"] == pytest.approx(plain[0]["members"], rel=1e-5)
    assert cal[0]["reference_members"] == pytest.approx(ref["members"], rel=1e-5)
    assert "reference_members" not in cal[1]
    ill = prompt_ensemble(tiny, tokenizer, items[:1], system_prompts=pool, reference="illustrate")
    want = prompt_ensemble(tiny, tokenizer, [illustrate(it)], system_prompts=pool)
    assert ill[0]["members"] == pytest.approx(want[0]["members"], rel=1e-5)
    with pytest.raises(ValueError, match="reference"):
        prompt_ensemble(tiny, tokenizer, items, reference="nope")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_eval_mtbench_calibrates_ensemble_features(tiny, tokenizer, tmp_path, monkeypatch,
                                                   capsys):
    """``eval mtbench --reference calibrate`` calibrates unt_exp / unt_var too (a tiny MT-Bench
    folder, the tiny model as the evaluator)."""
    import icqs_fast.models
    from icqs_fast.cli import main

    _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 1, "turns": ["What is the capital of France?", "And of Italy?"]},
        {"question_id": 2, "turns": ["Write a haiku about rain.", "Now one about snow."]}])
    _write_jsonl(tmp_path / "model_answer_m.jsonl", [
        {"question_id": 1, "choices": [{"turns": ["Paris is the capital.", "Rome."]}]},
        {"question_id": 2, "choices": [{"turns": ["Rain on the roof.", "Snow on the hill."]}]}])
    _write_jsonl(tmp_path / "reference_answer_gpt-4.jsonl", [
        {"question_id": 1, "choices": [{"turns": ["Paris.", "Rome."]}]}])
    _write_jsonl(tmp_path / "judgment_gpt-4_single.jsonl", [
        {"question_id": q, "model": "m", "turn": t, "score": s}
        for q, t, s in ((1, 1, 8), (1, 2, 6), (2, 1, 3))])
    monkeypatch.setattr(icqs_fast.models, "load_model", lambda *a, **k: (tiny, tokenizer))
    out = {}
    for ref in ("none", "calibrate"):
        assert main(["eval", "mtbench", "--data", str(tmp_path), "--json", "--features",
                     "unt_exp", "unt_var", "--reference", ref,
                     "--calibration-factor", "0.5"]) == 0
        out[ref] = json.loads(capsys.readouterr().out)["records"]
    from icqs_fast.io.datasets import load_mtbench

    items = [r["item"] for r in load_mtbench(tmp_path)]
    want = prompt_ensemble(tiny, tokenizer, items, reference="calibrate", calibration_factor=0.5)
    for rec, w in zip(out["calibrate"], want, strict=True):
        for k in ("unt_exp", "unt_var"):
            assert rec[k] == pytest.approx(w[k], rel=1e-5, abs=1e-12), k
    # Questions 1 (turns 1 and 2) have a reference: their values change; question 2 keeps its.
    assert out["calibrate"][0]["unt_exp"] != pytest.approx(out["none"][0]["unt_exp"], rel=1e-3)
    assert out["calibrate"][2]["unt_exp"] == pytest.approx(out["none"][2]["unt_exp"], rel=1e-5)


def _sample_direct(model, tokenizer, item, seed, steps):
    """Independent ancestral sampling (no KV cache, no ``generate``): full forward per step,
    fp32 softmax of the last logits, ``torch.multinomial`` under ``manual_seed(seed)``; stops
    after EOS and decodes without special tokens."""
    from dataclasses import replace

    ids = torch.tensor([encode(tokenizer, replace(as_item(item), response="")).ids],
                       device=DEVICE)
    torch.manual_seed(seed)
    new = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1)
        if int(nxt) == tokenizer.eos_token_id:
            break
        new.append(int(nxt))
        ids = torch.cat([ids, nxt[None]], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_decoding_ensemble_seeded(tiny, tokenizer):
    """Member j is the sample drawn under seed + j (checked against an independent sampling
    loop), and unt_exp / unt_var are the mean / population variance of the members' sentence
    probabilities exp(mean token logprob) from the float64 reference forward."""
    from dataclasses import replace

    k, seed, steps = 3, 3, 4
    got = decoding_ensemble(tiny, tokenizer, ITEMS[:2], k=k, max_new_tokens=steps, seed=seed)
    assert len(got) == 2
    for item, r in zip(ITEMS[:2], got, strict=True):
        want = [_sample_direct(tiny, tokenizer, item, seed + j, steps) for j in range(k)]
        assert r["samples"] == want
        assert len(set(want)) == k  # the seeds differ per member (a random model: ~uniform)
        ref = reference_features(tiny, tokenizer, [replace(as_item(item), response=s)
                                                   for s in want])
        probs = [math.exp(x["sent_logprob"]) for x in ref]
        mean = sum(probs) / k
        var = sum((p - mean) ** 2 for p in probs) / k
        assert r["members"] == pytest.approx(probs, rel=1e-4)
        assert r["unt_exp"] == pytest.approx(mean, rel=1e-4)
        # The variance of nearly equal members cancels: compare on the scale of mean**2.
        assert r["unt_var"] == pytest.approx(var, rel=1e-3, abs=1e-6 * mean**2)


def test_reference_illustration_and_calibration(tiny, tokenizer):
    it = as_item(ITEMS[0])
    ill = illustrate(it)
    assert ill.history == ((it.instruction, it.reference),)
    assert illustrate(ITEMS[1]) == as_item(ITEMS[1])  # no reference: unchanged
    keys = [k for k in ALL_FEATURES if k != "softmax_combo"]
    plain = glassbox(tiny, tokenizer, ITEMS[:2], features=keys)
    as_resp = glassbox(tiny, tokenizer, [(it.instruction, it.reference)], features=keys)[0]
    cal = calibrate(tiny, tokenizer, ITEMS[:2], factor=0.5, features=keys)
    for k in keys:
        assert cal[0][k] == pytest.approx(plain[0][k] - 0.5 * as_resp[k], abs=2e-5)
        assert cal[1][k] == pytest.approx(plain[1][k], abs=2e-5)  # no reference
    via = glassbox(tiny, tokenizer, ITEMS[:2], features=keys, reference="calibrate",
                   calibration_factor=0.5)
    _close(via, cal, atol=1e-6, keys=keys)
    ill_f = glassbox(tiny, tokenizer, ITEMS[:1], features=keys, reference="illustrate")
    _close(ill_f, glassbox(tiny, tokenizer, [ill], features=keys), atol=1e-6, keys=keys)


def test_embedded_model_matches_reference(embedded):
    model, tok = embedded
    got = glassbox(model, tok, ITEMS[:3], batch_size=3)
    # Reference in the model's fp32 weights, log_softmax / entropies in float64.
    want = reference_features(model, tok, ITEMS[:3], f64=False)
    _close(got, want, atol=2e-3, rtol=2e-4, keys=ALL_FEATURES)


@pytest.mark.slow
def test_eval_mtbench_three_answers(capsys):
    if not (DATA / "judgment_gpt-4_single.jsonl").is_file():
        skip_unless_in_ci(f"MT-Bench data not found at {DATA}")
    from icqs_fast.cli import main
    from icqs_fast.io.datasets import load_mtbench

    recs = load_mtbench(DATA)
    assert len(recs) == 318 and all(r["score"] >= 1 for r in recs)
    t2 = next(r for r in recs if r["turn"] == 2)
    assert len(t2["item"]["history"]) == 1
    assert main(["eval", "mtbench", "--data", str(DATA), "--limit", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta"]["n"] == 3 and len(out["records"]) == 3
    assert set(out["correlations"]) == set(ALL_FEATURES)
    for rec in out["records"]:
        assert all(math.isfinite(rec[f]) for f in ALL_FEATURES)


@pytest.mark.parametrize("kind", ["mistral", "mamba", "prophetnet"])
def test_glassbox_follows_the_capability_plan(kind):
    """Glass-box features on a windowed model (the fused head on its body), a recurrent one and
    one scored from its own logits: the sentence log-prob equals the model's own log-softmax at
    the response tokens, batched and alone."""
    from model_matrix import tiny_model
    from transformers import AutoTokenizer

    from icqs_fast import models
    from icqs_fast.features.extract import as_item, encode, glassbox

    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    model = tiny_model(kind, len(tok), window=16)
    items = [("Write one sentence about the sea and the ships that sail on it.",
              "The sea is wide and the ships are small."), ("Say hi", "Hi!")]
    got = glassbox(model, tok, items, features=["sent_logprob"], batch_size=2)
    for it, row in zip(items, got, strict=True):
        enc = encode(tok, as_item(it))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([enc.ids])).logits[0].double()
        pos = torch.arange(enc.prompt_len - 1, len(enc.ids) - 1)
        lp = torch.log_softmax(logits, -1)[pos, torch.tensor(enc.ids[enc.prompt_len:])]
        assert row["sent_logprob"] == pytest.approx(float(lp.mean()), abs=1e-4)
