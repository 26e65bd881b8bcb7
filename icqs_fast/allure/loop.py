"""The ALLURE loop: evaluate, collect mistakes, audit them into in-context examples, repeat.

Round ``r`` (``r = 0, 1, ...``):

1. evaluate the training and the held-out split with the memory accepted before round ``r``
   (round 0: the initial memory, usually empty);
2. stop after round ``rounds``, or when the *training* accuracy did not improve on the previous
   round (the held-out split is never used to steer the loop);
3. collect the training mistakes - false positives and false negatives separately, each list
   ordered by the evaluator's confidence in its wrong label - and build an in-context example
   from each (:func:`icqs_fast.allure.evaluators.make_example`);
4. the audit accepts or rejects each candidate (:class:`AutoAudit`, :class:`AcceptAll`,
   :class:`CallableAudit`, :class:`FileAudit`); at most ``max_new`` accepted ones, taken
   alternately from the two error kinds, are appended to the memory (round ``r``);
5. stop when none was accepted (the next round would repeat this one).

Every round writes one line to the round log (``MEMORY.rounds.jsonl`` beside a file memory) with
its metrics, the held-out predictions and its candidates, before the audit; ``resume`` continues
from the log without evaluating a logged round again.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icqs_fast import metrics as M
from icqs_fast.allure.data import AuditRecord, TaskSpec
from icqs_fast.allure.evaluators import Evaluator, Judgment, evaluate_both_orders, make_example
from icqs_fast.allure.memory import Memory, MemoryEntry
from icqs_fast.io.readers import read_json_objects
from icqs_fast.io.results import JsonlWriter, read_resume_state

# --------------------------------------------------------------------------- metrics


def failure_mode(spec: TaskSpec, truth: str, predicted: str) -> str:
    """``false_positive`` (the positive option for another truth), ``false_negative`` (another
    option for a positive truth), or ``predicted X for Y`` between two non-positive options."""
    if predicted == spec.positive:
        return "false_positive"
    if truth == spec.positive:
        return "false_negative"
    return f"predicted {predicted} for {truth}"


def score_judgments(spec: TaskSpec, truths: Sequence[str], judgments: Sequence[Judgment]
                    ) -> dict[str, Any]:
    """Accuracy, F1 and AUC of the positive option (AUC on its probability), Cohen's kappa
    against the truth, and the count of each error kind. Undefined values (one class only)
    are NaN."""
    pred = [j.label for j in judgments]
    score = [j.probs[spec.positive] for j in judgments]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = {"n": len(pred), "accuracy": M.accuracy(truths, pred),
               "f1": M.f1(truths, pred, positive=spec.positive),
               "auc": M.auc(truths, score, positive=spec.positive),
               "kappa": M.cohen_kappa(truths, pred)}
    errors: dict[str, int] = {"false_positive": 0, "false_negative": 0}
    for t, p in zip(truths, pred, strict=True):
        if t != p:
            k = failure_mode(spec, t, p)
            errors[k] = errors.get(k, 0) + 1
    out["errors"] = errors
    return out


# --------------------------------------------------------------------------- audits


@dataclass
class Candidate:
    """A training mistake proposed as an in-context example."""

    id: str
    round: int
    record: AuditRecord
    predicted: str
    confidence: float
    failure_mode: str

    def entry(self, spec: TaskSpec, audit: str) -> MemoryEntry:
        return MemoryEntry(id=self.id, round=self.round, split="train",
                           failure_mode=self.failure_mode, record=self.record,
                           example=make_example(spec, self.record), predicted=self.predicted,
                           confidence=self.confidence, audit=audit)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "round": self.round, "record_id": self.record.id,
                "predicted": self.predicted, "truth": self.record.truth,
                "confidence": self.confidence, "failure_mode": self.failure_mode}


class AutoAudit:
    """Automatic audit by a stated rule: accept a mistake when the evaluator's probability of
    its wrong label was at least ``threshold`` (a confidently wrong label is a real failure mode;
    a near coin-flip is more likely noise). Reported as automatic, not as a human audit."""

    def __init__(self, threshold: float = 0.6) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"audit threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self.name = f"auto: accept when P(wrong label) >= {threshold:g}"

    def decide(self, round_: int, candidates: Sequence[Candidate]) -> list[bool]:
        return [c.confidence >= self.threshold for c in candidates]


class AcceptAll:
    """No audit: every mistake becomes an example."""

    name = "none: every mistake accepted"

    def decide(self, round_: int, candidates: Sequence[Candidate]) -> list[bool]:
        return [True] * len(candidates)


class CallableAudit:
    """An audit by a function ``fn(candidate) -> bool`` (e.g. an interactive reviewer)."""

    def __init__(self, fn: Callable[[Candidate], bool], name: str = "callable") -> None:
        self.fn, self.name = fn, name

    def decide(self, round_: int, candidates: Sequence[Candidate]) -> list[bool]:
        return [bool(self.fn(c)) for c in candidates]


class FileAudit:
    """An audit by a file the user edits between rounds.

    At the first call for a round its candidates are appended to ``path`` (JSONL, one per line,
    with the round, the example's text and ``"accept": null``) and :meth:`decide` returns None:
    the loop stops and asks for the file to be edited. Set ``accept`` to ``true`` or ``false``
    on every line of the round, then run again with ``resume``; decisions are read back by
    (round, candidate id), so the file keeps every round's decisions and a resume that passes an
    earlier round again finds them there.
    """

    def __init__(self, path: str | os.PathLike, spec: TaskSpec) -> None:
        self.path = Path(path)
        self.spec = spec
        self.name = f"file: decisions read from {self.path}"

    def _read(self, round_: int) -> dict[str, Any]:
        got: dict[str, Any] = {}
        if not self.path.is_file():
            return got
        for lineno, obj in read_json_objects(self.path, allow_empty=True):
            if obj.get("round") == round_:
                acc = obj.get("accept")
                if acc is not None and not isinstance(acc, bool):
                    raise ValueError(f"{self.path}:{lineno}: field 'accept' must be true, "
                                     f"false or null, got {acc!r}")
                got[obj.get("id")] = acc
        return got

    def decide(self, round_: int, candidates: Sequence[Candidate]) -> list[bool] | None:
        got = self._read(round_)
        if all(c.id in got for c in candidates):
            if all(got[c.id] is not None for c in candidates):
                return [bool(got[c.id]) for c in candidates]
            return None  # written, not fully decided yet
        with JsonlWriter(self.path, append=True, fsync_every=0) as w:
            for c in candidates:
                if c.id in got:
                    continue
                ex = make_example(self.spec, c.record)
                w.write({**c.to_json(), "example": {"user": ex.user, "assistant": ex.assistant},
                         "accept": None})
        return None


# --------------------------------------------------------------------------- the loop


@dataclass
class RoundResult:
    """One evaluated round (one line of the round log)."""

    round: int
    memory_size: int
    train: dict[str, Any]
    heldout: dict[str, Any]
    candidates: list[dict[str, Any]]
    heldout_pred: dict[str, list]  # record id -> [label, P(positive)]
    seconds: float
    attn_entropy: float | None = None
    heldout_features: dict[str, dict[str, float]] = field(default_factory=dict)
    accepted: list[str] = field(default_factory=list)
    # Pairwise tasks judged in both orders: record id -> [given-order label, its P(first
    # option), swapped-order label, its P(first option)], the swapped order mapped back to the
    # original meaning (empty: not judged swapped).
    heldout_orders: dict[str, list] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.round, "round": self.round, "memory_size": self.memory_size,
                "train": self.train, "heldout": self.heldout, "candidates": self.candidates,
                "heldout_pred": self.heldout_pred, "seconds": self.seconds,
                "attn_entropy": self.attn_entropy, "heldout_features": self.heldout_features,
                "heldout_orders": self.heldout_orders}

    def features_mean(self) -> dict[str, float]:
        """Mean of each glass-box feature over the held-out records."""
        rows = list(self.heldout_features.values())
        keys = sorted({k for r in rows for k in r})
        return {k: sum(r[k] for r in rows if k in r) / max(1, sum(k in r for r in rows))
                for k in keys}


@dataclass
class AuditResult:
    """What :func:`audit` returns.

    Attributes:
        rounds: the evaluated rounds, in order.
        memory: the memory (all accepted entries).
        final_memory: the entries the last evaluated round used.
        stopped: why the loop ended (``rounds``, ``no improvement``, ``no new examples``,
            ``awaiting audit``).
        audit: the audit's description (how examples were accepted).
    """

    rounds: list[RoundResult]
    memory: Memory
    final_memory: list[MemoryEntry]
    stopped: str
    audit: str


def rounds_path(memory_path: str | os.PathLike) -> Path:
    """The round log beside a memory file: ``MEMORY.rounds.jsonl``."""
    p = Path(memory_path)
    return p.with_name(p.name + ".rounds.jsonl")


def read_round_log(path: str | os.PathLike) -> list[RoundResult]:
    """The complete rounds of a round log (an incomplete last line is ignored)."""
    p = Path(path)
    if not p.is_file():
        return []
    end = read_resume_state(p).end
    out = []
    with open(p, "rb") as f:
        data = f.read(end)
    for raw in data.splitlines():
        if raw.strip():
            o = json.loads(raw)
            out.append(RoundResult(o["round"], o["memory_size"], o["train"], o["heldout"],
                                   o["candidates"], o["heldout_pred"], o["seconds"],
                                   o.get("attn_entropy"), o.get("heldout_features", {}),
                                   heldout_orders=o.get("heldout_orders", {})))
    return out


def _candidates(spec: TaskSpec, round_: int, train: Sequence[AuditRecord],
                judgments: Sequence[Judgment]) -> list[Candidate]:
    """Training mistakes as candidates: false positives and false negatives (and other
    confusions) each ordered by confidence in the wrong label, then interleaved."""
    by_kind: dict[str, list[Candidate]] = {}
    for r, j in zip(train, judgments, strict=True):
        if j.label != r.truth:
            kind = failure_mode(spec, r.truth, j.label)
            by_kind.setdefault(kind, []).append(
                Candidate(f"r{round_}:{r.id}", round_, r, j.label, j.confidence(), kind))
    lists = [sorted(v, key=lambda c: (-c.confidence, c.id)) for _, v in sorted(by_kind.items())]
    out = []
    for k in range(max((len(v) for v in lists), default=0)):
        out.extend(v[k] for v in lists if k < len(v))
    return out


def _orders(spec: TaskSpec, records: Sequence[AuditRecord], judgments: Sequence[Judgment]
            ) -> dict[str, list]:
    first = spec.options[0]
    return {r.id: [j.orders[0].label, j.orders[0].probs[first], j.orders[1].label,
                   j.orders[1].probs[first]]
            for r, j in zip(records, judgments, strict=True) if j.orders is not None}


def audit(
    evaluator: Evaluator,
    train: Sequence[AuditRecord],
    heldout: Sequence[AuditRecord],
    *,
    rounds: int = 3,
    auditor: Any = None,
    memory: Memory | None = None,
    max_new: int = 8,
    patience: bool = True,
    attn_items: int = 0,
    swap: bool = False,
    log_path: str | os.PathLike | None = None,
    resume: bool = False,
    progress: Callable[[str, int], Callable | None] | None = None,
    log: Callable[[str], None] | None = None,
) -> AuditResult:
    """Run the ALLURE loop (see the module docstring).

    Args:
        evaluator: a :class:`LikelihoodEvaluator`, :class:`ICQSEvaluator` or anything with
            ``spec`` and ``evaluate(records, memory)``.
        train, heldout: the two splits; held-out records never enter the memory.
        rounds: most memory updates (rounds ``0..rounds`` are evaluated).
        auditor: an object with ``name`` and ``decide(round, candidates) -> list[bool] | None``
            (None: decisions pending, the loop stops); default :class:`AutoAudit`. A resume
            asks it again for the rounds it passes from the log (entries already in the memory
            are not appended twice), so it must decide the same way (the audits here do).
        memory: the memory (a :class:`Memory`; file-backed to keep it), default empty.
        max_new: most examples accepted per round.
        patience: stop when the training accuracy does not improve on the previous round.
        attn_items: held-out records whose attention entropy is measured each round (0: none;
            the evaluator needs an ``attention_entropy`` method).
        swap: a pairwise task: judge each held-out pair also with its outputs swapped
            (:func:`icqs_fast.allure.evaluators.evaluate_both_orders`, in the same scoring
            call) and keep both orders' verdicts in :attr:`RoundResult.heldout_orders`, for the
            position-swap statistics; the reported verdict stays the evaluator's own. An
            evaluator that judges both orders itself (``both_orders``, e.g.
            :class:`~icqs_fast.allure.evaluators.OrderAveragedEvaluator`) is not asked twice.
        log_path: the round log (default: beside a file memory; none for an in-object one).
        resume: continue from the round log and the memory.
        progress: ``progress(desc, total)`` returns a callback ``(n)`` advanced per records
            done (e.g. a progress bar), or None.
        log: a callable for status lines.

    Returns:
        an :class:`AuditResult`.
    """
    spec = evaluator.spec
    auditor = auditor if auditor is not None else AutoAudit()
    memory = memory if memory is not None else Memory()
    memory.forbid(r.id for r in heldout)
    overlap = {r.id for r in train} & {r.id for r in heldout}
    if overlap:
        raise ValueError(f"records in both splits: {sorted(overlap)[:3]}")
    if rounds < 0 or max_new < 1:
        raise ValueError(f"rounds must be >= 0 and max_new >= 1, got {rounds}, {max_new}")
    say = log or (lambda s: None)
    if log_path is None and memory.path is not None:
        log_path = rounds_path(memory.path)
    done = read_round_log(log_path) if (resume and log_path is not None) else []
    if done or (resume and log_path is not None and Path(log_path).is_file()):
        end = read_resume_state(log_path).end
        if Path(log_path).stat().st_size != end:
            with open(log_path, "r+b") as f:  # drop a round line cut off mid-write
                f.truncate(end)
    writer = JsonlWriter(log_path, append=resume, fsync_every=0) if log_path else None
    by_id = {r.id: r for r in train}
    results: list[RoundResult] = []
    stopped = "rounds"
    try:
        for r in range(rounds + 1):
            mem = memory.before(r)
            if r < len(done):
                res = done[r]
                say(f"round {r}: from the log ({len(mem)} examples)")
                cands = [Candidate(c["id"], r, by_id[c["record_id"]], c["predicted"],
                                   c["confidence"], c["failure_mode"]) for c in res.candidates]
            else:
                t0 = time.perf_counter()
                tick = progress(f"round {r}", len(train) + len(heldout)) if progress else None
                jt = evaluator.evaluate(train, mem, progress=tick)
                if swap and not getattr(evaluator, "both_orders", False):
                    jh = evaluate_both_orders(evaluator, heldout, mem, progress=tick)
                else:
                    jh = evaluator.evaluate(heldout, mem, progress=tick)
                attn = None
                if attn_items > 0:
                    vals = evaluator.attention_entropy(list(heldout)[:attn_items], mem)
                    attn = sum(vals) / len(vals)
                cands = _candidates(spec, r, train, jt)
                res = RoundResult(
                    r, len(mem), score_judgments(spec, [x.truth for x in train], jt),
                    score_judgments(spec, [x.truth for x in heldout], jh),
                    [c.to_json() for c in cands],
                    {x.id: [j.label, j.probs[spec.positive]] for x, j in zip(heldout, jh,
                                                                             strict=True)},
                    time.perf_counter() - t0, attn,
                    {x.id: dict(j.features) for x, j in zip(heldout, jh, strict=True)},
                    heldout_orders=_orders(spec, heldout, jh) if swap else {})
                if writer is not None:
                    writer.write(res.to_json())
                h = res.heldout
                say(f"round {r}: {len(mem)} examples; held-out accuracy {h['accuracy']:.3f} "
                    f"f1 {h['f1']:.3f} auc {h['auc']:.3f} kappa {h['kappa']:.3f}; train "
                    f"accuracy {res.train['accuracy']:.3f}; {len(cands)} mistakes "
                    f"({res.seconds:.1f} s)")
            results.append(res)
            if r == rounds:
                stopped = "rounds"
                break
            if patience and r >= 1 and not (res.train["accuracy"] >
                                            results[-2].train["accuracy"]):
                stopped = "no improvement"
                break
            if not cands:
                stopped = "no new examples"
                break
            decisions = auditor.decide(r, cands)
            if decisions is None:
                stopped = "awaiting audit"
                say(f"round {r}: {len(cands)} candidates await the audit ({auditor.name}); "
                    "decide them and resume")
                break
            have = memory.ids()
            accepted = [c for c, ok in zip(cands, decisions, strict=True) if ok][:max_new]
            for c in accepted:
                if c.id not in have:  # a resumed round may have appended some already
                    memory.append(c.entry(spec, auditor.name))
            res.accepted = [c.id for c in accepted]
            say(f"round {r}: {len(accepted)} of {len(cands)} mistakes accepted "
                f"({auditor.name})")
            if not accepted:
                stopped = "no new examples"
                break
    finally:
        if writer is not None:
            writer.close()
        memory.close()
    last = results[-1].round if results else 0
    return AuditResult(results, memory, memory.before(last), stopped, auditor.name)
