"""ALLURE audit loop: the loop on a synthetic task where the right examples provably help, the
memory's append-only / resume / held-out rules, the likelihood evaluator against a plain full
forward, one prefix computation per record for all its options, and the CLI end to end."""

import json
import math
import os

import pytest
import torch

from icqs_fast import models
from icqs_fast.allure import (
    AcceptAll,
    AuditRecord,
    AutoAudit,
    FileAudit,
    HeldoutLeakError,
    Judgment,
    LikelihoodEvaluator,
    Memory,
    MemoryEntry,
    audit,
    custom_task,
    label_truth,
    make_example,
    regex_truth,
    score_judgments,
    split,
    spread,
    studies,
)
from icqs_fast.allure.loop import read_round_log, rounds_path
from icqs_fast.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------- synthetic task
# A deterministic fake "LM" judge. Its own verdict comes from a cue word ("right" -> correct,
# "wrong" -> incorrect); a response with a deceiving marker ("certainly", "lengthy") fools it
# into "correct" with some confidence. Each in-context example whose response carries the same
# marker pushes the positive option's logit by +-STRENGTH towards the example's label. So
# examples of a failure mode fix that mode on unseen (held-out) records; nothing else does.

MARKERS = {"certainly": 1.2, "lengthy": 0.8, "maybe": 0.05}
STRENGTH = 1.5


def _logit(rec, memory):
    words = set(rec.fields["response"].split())
    z = 2.0 if "right" in words else -2.0
    for m, bias in MARKERS.items():
        if m in words:
            z = bias  # deceived: leans "correct" whatever the cue
            for e in memory:
                if m in e.record.fields["response"].split():
                    z += STRENGTH if e.record.truth == "1" else -STRENGTH
    return z


class FakeJudge:
    def __init__(self):
        self.spec = custom_task()
        self.calls = 0

    def describe(self):
        return "fake"

    def evaluate(self, records, memory, *, progress=None):
        self.calls += 1
        out = []
        for r in records:
            p1 = 1.0 / (1.0 + math.exp(-_logit(r, memory)))
            out.append(Judgment("1" if p1 >= 0.5 else "0", {"1": p1, "0": 1.0 - p1}))
        return out


def synthetic(n_per_mode=6):
    recs = []
    i = 0
    for cue, truth in (("right", "1"), ("wrong", "0")):
        for _ in range(n_per_mode):
            recs.append(AuditRecord(f"n{i}", {"task": f"q{i}", "response": f"a {cue} one"},
                                    truth))
            i += 1
    for m in MARKERS:
        for k in range(n_per_mode):
            # Deceiving marker on wrong answers, a few right answers carry it too.
            truth = "1" if k == 0 else "0"
            cue = "right" if truth == "1" else "wrong"
            recs.append(AuditRecord(f"{m}{k}", {"task": f"q{i}",
                                                "response": f"{m} {cue} answer {k}"}, truth))
            i += 1
    return recs


def test_loop_right_examples_raise_heldout_metric(tmp_path):
    train, held = split(synthetic(), 0.5, seed=3)
    judge = FakeJudge()
    mem = Memory(tmp_path / "mem.jsonl")
    res = audit(judge, train, held, rounds=3, auditor=AutoAudit(0.6), memory=mem, max_new=4)
    acc = [r.heldout["accuracy"] for r in res.rounds]
    # The first examples fix the deceived modes on unseen records; later rounds may dip (the
    # few right answers with a marker become false negatives, as in the study's dip).
    assert acc[1] > acc[0] + 0.2 and max(acc[1:]) == 1.0, acc
    # Independent count of held-out mistakes at round 0: every deceived wrong answer with a
    # marker whose bias makes P(1) >= 0.5.
    want0 = sum(1 for r in held if r.truth == "0" and any(m in r.fields["response"]
                                                          for m in MARKERS))
    assert res.rounds[0].heldout["errors"]["false_positive"] == want0
    ids = {e.record.id for e in res.memory}
    assert ids and ids <= {r.id for r in train}
    assert all(e.failure_mode == "false_positive" for e in res.memory if e.round == 0)
    # The auto rule rejects the near coin-flip "maybe" mistakes (P(wrong) = 0.51 < 0.6).
    assert not any("maybe" in e.record.fields["response"] for e in res.memory)
    assert all(e.audit.startswith("auto") for e in res.memory)
    assert res.stopped in ("rounds", "no new examples", "no improvement")


def test_metrics_against_sklearn_free_reference():
    spec = custom_task()
    truths = ["1", "1", "0", "0", "1"]
    js = [Judgment(lab, {"1": p, "0": 1 - p}) for lab, p in
          [("1", .9), ("0", .4), ("1", .7), ("0", .2), ("1", .6)]]
    s = score_judgments(spec, truths, js)
    assert s["accuracy"] == pytest.approx(3 / 5)
    # precision 2/3, recall 2/3 -> f1 2/3
    assert s["f1"] == pytest.approx(2 / 3)
    # AUC: pairs (pos, neg) with pos score > neg: (.9>.7,.9>.2,.4<.7,.4>.2,.6<.7,.6>.2) = 4/6
    assert s["auc"] == pytest.approx(4 / 6)
    assert s["errors"] == {"false_positive": 1, "false_negative": 1}
    po, pe = 3 / 5, (3 / 5 * 3 / 5 + 2 / 5 * 2 / 5)
    assert s["kappa"] == pytest.approx((po - pe) / (1 - pe))


def test_memory_append_only_and_resume(tmp_path):
    recs = synthetic()
    train, held = split(recs, 0.5, seed=3)
    path = tmp_path / "mem.jsonl"
    j1 = FakeJudge()
    r1 = audit(j1, train, held, rounds=1, auditor=AcceptAll(), memory=Memory(path), max_new=2,
               patience=False)
    first = path.read_bytes()
    n1 = len(r1.memory)
    assert n1 == 2 and len(read_round_log(rounds_path(path))) == 2
    # A crash mid-write leaves half a line in either file; resuming drops it.
    for p in (path, rounds_path(path)):
        with open(p, "ab") as f:
            f.write(b'{"index": 9, "id": "r9:x", "rou')
    # Resume with more rounds: logged rounds are not evaluated again, the file only grows.
    j2 = FakeJudge()
    r2 = audit(j2, train, held, rounds=3, auditor=AcceptAll(), memory=Memory(path).load(),
               max_new=2, patience=False, resume=True)
    assert path.read_bytes().startswith(first) and len(r2.memory) > n1
    assert [r.round for r in r2.rounds] == list(range(len(r2.rounds)))
    assert r2.rounds[0].heldout == r1.rounds[0].heldout
    # Rounds 0 and 1 come from the log: evaluations only from round 2 on (train + held-out).
    assert j2.calls == 2 * (len(r2.rounds) - 2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(len(lines)))
    assert len({x["id"] for x in lines}) == len(lines)
    assert all(x["split"] == "train" for x in lines)


def test_heldout_never_enters_memory(tmp_path):
    train, held = split(synthetic(), 0.5, seed=1)
    mem = Memory(tmp_path / "m.jsonl")
    # Every held-out record is a mistake the judge would make; none may be accepted.
    res = audit(FakeJudge(), train, held, rounds=2, auditor=AcceptAll(), memory=mem, max_new=50,
                patience=False)
    held_ids = {r.id for r in held}
    assert not held_ids & {e.record.id for e in res.memory}
    spec = custom_task()
    bad = MemoryEntry("x", 0, "train", "false_positive", held[0], make_example(spec, held[0]))
    with pytest.raises(HeldoutLeakError):
        mem.append(bad)
    with pytest.raises(HeldoutLeakError):
        Memory().append(MemoryEntry("y", 0, "heldout", "fp", train[0],
                                    make_example(spec, train[0])))
    # A memory file written with another split (it holds a record now held out) is refused.
    other = Memory(tmp_path / "o.jsonl")
    other.append(MemoryEntry("z", 0, "train", "fp", held[0], make_example(spec, held[0])))
    other.close()
    with pytest.raises(HeldoutLeakError):
        audit(FakeJudge(), train, held, rounds=1, memory=Memory(tmp_path / "o.jsonl").load())


def test_file_audit_waits_then_resumes(tmp_path):
    train, held = split(synthetic(), 0.5, seed=3)
    path = tmp_path / "mem.jsonl"
    fa = FileAudit(tmp_path / "cand.jsonl", custom_task())
    r = audit(FakeJudge(), train, held, rounds=2, auditor=fa, memory=Memory(path))
    assert r.stopped == "awaiting audit" and len(r.memory) == 0
    lines = [json.loads(x) for x in (tmp_path / "cand.jsonl").read_text().splitlines()]
    assert lines and all(x["accept"] is None for x in lines)
    for k, x in enumerate(lines):
        x["accept"] = k == 0
    (tmp_path / "cand.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r2 = audit(FakeJudge(), train, held, rounds=2, auditor=fa, memory=Memory(path).load(),
               resume=True)
    assert [e.id for e in r2.memory][:1] == [lines[0]["id"]]
    assert r2.memory.entries[0].audit.startswith("file")
    # Round 1's candidates are now pending in the same file; resuming again without deciding
    # passes round 0 from the file's kept decisions and waits at round 1 again.
    assert r2.stopped == "awaiting audit" and len(r2.rounds) == 2
    r3 = audit(FakeJudge(), train, held, rounds=2, auditor=fa, memory=Memory(path).load(),
               resume=True)
    assert r3.stopped == "awaiting audit" and len(r3.rounds) == 2 and len(r3.memory) == 1


def test_truth_spread_split():
    assert regex_truth("The answer is 42.", "42") == "1"
    assert regex_truth("The answer is 420.", "42") == "0"
    assert regex_truth("ANSWER:  Paris", "paris", pattern=r"^answer: {answer}$") == "1"
    with pytest.raises(ValueError, match="answer"):
        regex_truth("x", "y", pattern="no placeholder")
    assert label_truth(2, ("A", "B"), {"1": "A", "2": "B"}) == "B"
    assert label_truth(1.0, ("0", "1")) == "1"
    with pytest.raises(ValueError, match="not one of"):
        label_truth("7", ("0", "1"))
    recs = [AuditRecord(str(i), {}, "1" if i % 10 == 0 else "0") for i in range(100)]
    got = spread(recs, 10, seed=5)
    assert [int(r.id) // 10 for r in got] == list(range(10))  # one per stratum, in order
    assert spread(recs, 10, seed=5) == got and spread(recs, 10, seed=6) != got
    bal = spread(recs, 10, seed=0, balance=True)
    assert sum(r.truth == "1" for r in bal) == 5
    tr, he = split(bal, 0.4, seed=0)
    assert not {r.id for r in tr} & {r.id for r in he} and len(tr) + len(he) == 10
    assert sum(r.truth == "1" for r in he) == 2


def test_clusters_and_sweep_on_synthetic(tmp_path):
    train, held = split(synthetic(), 0.5, seed=3)
    judge = FakeJudge()
    res = audit(judge, train, held, rounds=1, auditor=AcceptAll(), memory=Memory(),
                max_new=6, patience=False)
    mem = res.final_memory
    # Hand-made 2-D "embeddings": one tight group per marker.
    vec = [[10.0 * ("certainly" in e.record.fields["response"]), 0.0] for e in mem]
    clusters, _, assign = studies.failure_clusters(judge.spec, mem, k=2, vectors=vec)
    by_marker = {}
    for e, a in zip(mem, assign, strict=True):
        by_marker.setdefault("certainly" in e.record.fields["response"], set()).add(a)
    assert all(len(v) == 1 for v in by_marker.values()) and len(clusters) == 2
    sw = studies.sweep(judge, held, mem, proportions=(0, 0.5, 1), seeds=(0, 1))
    assert [s["n_examples"] for s in sw] == [0, len(mem) // 2, len(mem)]
    assert sw[-1]["accuracy"] == pytest.approx(res.rounds[-1].heldout["accuracy"])
    assert sw[0]["accuracy"] == pytest.approx(res.rounds[0].heldout["accuracy"])
    full = [res.rounds[-1].heldout_pred[r.id][0] for r in held]
    ab = studies.ablation(judge, held, mem, clusters, full)
    # Removing the "certainly" cluster brings back exactly its held-out false positives.
    cert = [a for a, c in zip(ab, clusters, strict=True)
            if any("certainly" in x["text"] for x in c.examples)]
    want = sum(1 for r in held if r.truth == "0" and "certainly" in r.fields["response"])
    assert cert[0]["changed"] == want


def test_embedding_model_is_offline():
    v = studies.embed(["the cat sat", "a cat was sitting", "stock prices fell"])
    assert v.shape == (3, 384)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2])


# --------------------------------------------------------------------------- real (tiny) LM


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    d = tiny_llama_dir(layers=2, max_positions=1024)
    return d, models.load_model(d, dtype="float32", device="cpu")


def _records(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    out = []
    for i in range(n):
        k = torch.randint(0, len(words), (4,), generator=g).tolist()
        out.append(AuditRecord(f"t{i}", {"task": f"Name {words[k[0]]} {i}",
                                         "response": " ".join(words[j] for j in k[1:])},
                               "1" if i % 2 else "0"))
    return out


def _entries(spec, recs):
    return [MemoryEntry(f"m{i}", 0, "train", "false_positive", r, make_example(spec, r))
            for i, r in enumerate(recs)]


@pytest.mark.slow
def test_option_scores_equal_plain_forward(tiny):
    _, (model, tok) = tiny
    spec = custom_task(options=("correct", "incorrect", "3"), positive="correct")
    ev = LikelihoodEvaluator(model, tok, spec)
    recs = _records(3)
    mem = _entries(spec, _records(2, seed=9))
    js = ev.evaluate(recs, mem)
    for r, j in zip(recs, js, strict=True):
        shared, own = ev.prompt_parts(r, mem)
        for o in spec.options:
            # Independent path: the whole text tokenised at once, the model's own logits.
            ids = tok(shared + own + o, add_special_tokens=True)["input_ids"]
            n_opt = len(tok(o, add_special_tokens=False)["input_ids"])
            enc = ev.encode(r, mem)
            assert ids == enc.context + ev.option_ids[o]  # no seam changes the tokens
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            want = sum(float(lp[t - 1, ids[t]]) for t in range(len(ids) - n_opt, len(ids)))
            assert j.logprobs[o] == pytest.approx(want, abs=1e-4)
            # The glass-box features come from the same forward: the decision position's
            # next-token distribution.
            d = lp[len(ids) - n_opt - 1]
            assert j.features["decision_entropy"] == pytest.approx(
                float(-(d.exp() * d).sum()), abs=1e-4)
            assert j.features["decision_max_logprob"] == pytest.approx(float(d.max()), abs=1e-4)
        p = torch.softmax(torch.tensor([j.logprobs[o] for o in spec.options]), 0)
        assert j.probs[j.label] == pytest.approx(float(p.max()), abs=1e-6)


def test_one_prefix_forward_per_record_for_all_options(tiny):
    from icqs_fast.engine.batching import _BankWriter
    from icqs_fast.engine.checks import check_model

    _, (model, tok) = tiny
    seen = {"bank": 0, "suffix_rows": 0, "suffix_len": set()}

    def pre(mod, args, kwargs):
        ids = kwargs["input_ids"]
        # The engine passes its cache as `cache=` where the model takes it, else as
        # `past_key_values=`.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, _BankWriter):
            # A prefix-bank forward: its real (non-pad) new tokens, the mask's last T columns.
            seen["bank"] += int(kwargs["attention_mask"][:, -ids.shape[1]:].sum())
        else:
            seen["suffix_rows"] += ids.shape[0]
            seen["suffix_len"].add(ids.shape[1])

    check_model(model)  # its one check forward is cached per model: not counted below
    h = model.model.register_forward_pre_hook(pre, with_kwargs=True)
    recs = _records(6)
    try:
        bank = {}
        for opts in (("0", "1"), ("1", "2", "3", "4", "5")):
            spec = custom_task(options=opts, positive=opts[-1])
            ev = LikelihoodEvaluator(model, tok, spec)
            mem = _entries(spec, _records(4, seed=3))
            seen.update(bank=0, suffix_rows=0, suffix_len=set())
            ev.evaluate(recs, mem)
            encs = [ev.encode(r, mem) for r in recs]
            assert ev.last_calls == 1 and ev.last_requests == len(recs) * len(opts)
            n_shared = encs[0].n_shared
            assert all(e.n_shared == n_shared for e in encs)
            own = sum(len(e.context) - 1 - n_shared for e in encs)
            bank[opts] = seen["bank"]
            # Prefix forwards: the shared instructions + memory once and each record's own part
            # once (at most; a second pass over the memory would exceed the bound).
            assert n_shared < bank[opts] <= n_shared + own
            # Suffix forwards: one one-token row per (record, option), nothing more.
            assert seen["suffix_rows"] == len(recs) * len(opts) and seen["suffix_len"] == {1}
        # More options add no prefix computation.
        assert bank[("0", "1")] == bank[("1", "2", "3", "4", "5")]
    finally:
        h.remove()


def test_attention_entropy_over_response(tiny):
    _, (model, tok) = tiny
    spec = custom_task()
    ev = LikelihoodEvaluator(model, tok, spec)
    recs = _records(2)
    e = ev.attention_entropy(recs, [])
    enc = ev.encode(recs[0], [])
    a, b = enc.response_span
    text = tok.decode(enc.context[a:b])
    assert recs[0].fields["response"] in text and b - a <= len(tok(text)["input_ids"]) + 1
    # Reference: eager attention probabilities of the last position, renormalised over the span.
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = model(torch.tensor([enc.context]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(prev)
    vals = []
    for layer in att:
        p = layer[0, :, -1, a:b].double()
        p = p / p.sum(-1, keepdim=True)
        vals.append(-(p * p.clamp_min(1e-300).log()).sum(-1))
    assert e[0] == pytest.approx(float(torch.stack(vals).mean()), abs=1e-4)
    assert 0 < e[0] <= math.log(b - a) + 1e-6


@pytest.mark.slow
def test_cli_custom_end_to_end(tiny, tmp_path, monkeypatch, capsys):
    model_dir, loaded = tiny
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)
    data = tmp_path / "d.jsonl"
    rows = [{"id": f"q{i}", "x": f"What is {i} plus {i}?", "y": f"It is {2 * i + (i % 3 == 0)}.",
             "answer": str(2 * i)} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mem = tmp_path / "mem.jsonl"
    base = ["audit", "--task", "custom", "--data", str(data), "--answer-field", "answer",
            "--model", str(model_dir), "--limit", "12", "--memory", str(mem), "--json",
            "--quiet", "--sweep-seeds", "2", "--clusters", "2", "--attn-items", "1",
            "--audit", "none", "--max-new", "3", "--no-patience"]
    assert main(base + ["--rounds", "1", "--plot", str(tmp_path / "plots")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["task"] == "custom" and rep["n_train"] + rep["n_heldout"] == 12
    assert [r["round"] for r in rep["rounds"]] == [0, 1]
    for k in ("accuracy", "f1", "auc", "kappa"):
        assert k in rep["rounds"][0]["heldout"]
    assert rep["sweep"] and rep["clusters"] and rep["ablation"]
    want = {"cluster", "accuracy", "f1", "auc", "kappa_vs_full", "errors"}
    assert want <= set(rep["ablation"][0])
    assert rep["attention"][0]["attn_entropy"] > 0
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"rounds.png", "sweep.png",
                                                                  "ablation.png"}
    # Truth from the regex: responses with a wrong sum (i % 3 == 0, i > 0) are incorrect.
    first = mem.read_bytes()
    for line in first.decode().splitlines():
        e = json.loads(line)
        want = "0" if int(e["record"]["id"][1:]) % 3 == 0 and e["record"]["id"] != "q0" else "1"
        assert e["record"]["truth"] == want
    # Resume with more rounds continues the same file; other settings are refused (exit 2).
    assert main(base + ["--rounds", "2", "--resume"]) == 0
    rep2 = json.loads(capsys.readouterr().out)
    assert mem.read_bytes().startswith(first) and len(rep2["rounds"]) == 3
    assert [r["heldout"] for r in rep2["rounds"][:2]] == [r["heldout"] for r in rep["rounds"]]
    assert main(base + ["--rounds", "2", "--resume", "--seed", "1"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert main(base + ["--rounds", "1"]) == 2  # exists: needs --resume or --overwrite
    # Bad input: the error names the file, the line and the field.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"id": "z", "x": "q"}) + "\n")
    assert main(["audit", "--task", "custom", "--data", str(bad), "--answer-field", "answer",
                 "--model", str(model_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "'y'" in err
    assert os.path.exists(f"{mem}.meta.json")


def test_icqs_evaluator_thresholds_the_icqs_score(tiny):
    from icqs_fast.allure import ICQSEvaluator
    from icqs_fast.engine.scorer import ICQSScorer

    _, (model, tok) = tiny
    spec = custom_task()
    recs = _records(6)
    good = [r for r in recs if r.truth == "1"][:1]
    bad = [r for r in recs if r.truth == "0"][:1]
    mem = _entries(spec, recs[2:4])
    ev = ICQSEvaluator(model, tok, spec, seed_good=good, seed_bad=bad, threshold=0.5)
    js = ev.evaluate(recs, mem)
    # Reference: a scorer built by hand from the seed pools plus the memory's records.
    pool = good + bad + [e.record for e in mem]
    ref = ICQSScorer(model, tok, [ev.xy(r) for r in pool if r.truth == "1"],
                     [ev.xy(r) for r in pool if r.truth == "0"], **ev.kw)
    want = [float(r.score) for r in ref.score([ev.xy(r) for r in recs])]
    assert [j.probs["1"] for j in js] == pytest.approx(want)
    assert [j.label for j in js] == ["1" if s >= 0.5 else "0" for s in want]
    # Calibrated, continuous ICQS reaches the evaluator's scorer; a bad option is
    # refused when the evaluator is built.
    cal = ICQSEvaluator(model, tok, spec, seed_good=good, seed_bad=bad, threshold=0.5,
                        calibration="pmi", score="mean")
    got = [j.probs["1"] for j in cal.evaluate(recs, mem)]
    ref = ICQSScorer(model, tok, [ev.xy(r) for r in pool if r.truth == "1"],
                     [ev.xy(r) for r in pool if r.truth == "0"], **cal.kw)
    assert ref.settings.calibration == "pmi" and "pmi" in cal.describe()
    assert got == pytest.approx([float(r.score) for r in ref.score([ev.xy(r) for r in recs])])
    # The message names the option by its flag (the one declaration: CLI and library alike).
    with pytest.raises(ValueError, match="--calibrate must be one of"):
        ICQSEvaluator(model, tok, spec, seed_good=good, seed_bad=bad, calibration="zhao")
