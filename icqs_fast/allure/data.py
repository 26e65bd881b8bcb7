"""Audit records and tasks: SummEval factual consistency, LLMBar pairwise preference and custom
JSONL files with configurable fields, plus the seeded ``--limit`` spread and the train /
held-out split.

An :class:`AuditRecord` holds the text fields a task's query template uses and its ground truth
(one of the task's option strings). A :class:`TaskSpec` says how a record becomes the
evaluator's user turn, which options the evaluator chooses from and which one is the positive
class (for F1 and AUC).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icqs_fast.allure.truth import label_truth, regex_truth
from icqs_fast.io.datasets import shared_data_dir
from icqs_fast.io.readers import read_json_objects
from icqs_fast.io.records import InputError, RecordError, field_of


@dataclass
class AuditRecord:
    """One (task, response[, reference]) item to label.

    Attributes:
        id: the record's id (from the file, else ``"<line>"``), unique within a data set.
        fields: the text fields the query template uses (e.g. ``article``, ``summary``).
        truth: the correct option (an element of the task's ``options``).
        line: 1-based line in the file (the item number for a JSON array), for messages.
    """

    id: str
    fields: dict[str, str]
    truth: str
    line: int = 0


@dataclass
class TaskSpec:
    """How records are shown to the evaluator.

    Attributes:
        name: task name (``summeval``, ``llmbar``, ``custom``).
        instructions: the evaluation instructions (the system turn).
        query_template: ``str.format`` template of the user turn over a record's fields.
        options: the labels the evaluator chooses from (each scored as a continuation).
        positive: the option counted as the positive class by F1 and scored by AUC.
        response_fields: the fields holding the response(s) under evaluation (the key range of
            the attention-entropy study).
        example_template: the user turn of an in-context example, formatted with ``{query}``
            (the record's query, long fields cut to ``example_max_chars``) and its fields.
        example_max_chars: fields longer than this are cut (with " ...") inside examples, so a
            memory of long articles stays within the model's length.
        descriptions: what each option means (for reports).
        pair_fields: a pairwise task's two compared fields (first, second), e.g.
            ``("output_1", "output_2")``: its two options then mean "the first is better" and
            "the second is better" (in that order), and :meth:`swapped` presents the pair in
            the other order for the position-swap statistics. None: not pairwise.
    """

    name: str
    instructions: str
    query_template: str
    options: tuple[str, ...]
    positive: str
    response_fields: tuple[str, ...]
    example_template: str = "{query}"
    example_max_chars: int | None = None
    descriptions: dict[str, str] = field(default_factory=dict)
    pair_fields: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if len(self.options) < 2 or len(set(self.options)) != len(self.options):
            raise ValueError(f"a task needs at least two distinct options, got {self.options}")
        if self.positive not in self.options:
            raise ValueError(f"positive option {self.positive!r} is not one of {self.options}")
        if self.pair_fields is not None and len(self.options) != 2:
            raise ValueError(f"a pairwise task has two options, got {self.options}")

    @property
    def pairwise(self) -> bool:
        """Whether records are pairs of outputs (:attr:`pair_fields` set)."""
        return self.pair_fields is not None

    def swap_label(self, label: str) -> str:
        """A pairwise task's label with the pair's order swapped (first <-> second)."""
        a, b = self.options
        return b if label == a else a

    def swapped(self, rec: AuditRecord) -> AuditRecord:
        """``rec`` with its two compared fields exchanged and its truth swapped accordingly
        (same id and line): the pair shown in the other order."""
        if self.pair_fields is None:
            raise ValueError(f"task {self.name!r} is not pairwise: no order to swap")
        f1, f2 = self.pair_fields
        fields = dict(rec.fields)
        fields[f1], fields[f2] = rec.fields[f2], rec.fields[f1]
        return AuditRecord(rec.id, fields, self.swap_label(rec.truth), rec.line)

    def length(self, rec: AuditRecord) -> float:
        """The length signal of the length-bias statistic, in characters: a pairwise task's
        first compared field's length minus the second's; else the response fields' total."""
        if self.pair_fields is not None:
            f1, f2 = self.pair_fields
            return float(len(rec.fields[f1]) - len(rec.fields[f2]))
        return float(sum(len(rec.fields.get(f, "")) for f in self.response_fields))

    def query(self, rec: AuditRecord) -> str:
        """The user turn that asks for ``rec``'s label."""
        return _format(self.query_template, rec, "query template")

    def example_user(self, rec: AuditRecord) -> str:
        """The user turn of an in-context example built from ``rec`` (long fields cut)."""
        cut = rec
        if self.example_max_chars is not None:
            m = self.example_max_chars
            cut = AuditRecord(rec.id, {k: v if len(v) <= m else v[:m].rstrip() + " ..."
                                       for k, v in rec.fields.items()}, rec.truth, rec.line)
        q = self.query(cut)
        return _format(self.example_template, cut, "example template", query=q)


def _format(template: str, rec: AuditRecord, what: str, **extra: str) -> str:
    try:
        return template.format(**rec.fields, **extra)
    except KeyError as exc:
        raise ValueError(f"{what} uses field {exc.args[0]!r}, which record {rec.id!r} does not "
                         f"have (fields: {', '.join(rec.fields)})") from None


# --------------------------------------------------------------------------- tasks

SUMMEVAL_TASK = TaskSpec(
    name="summeval",
    instructions=("You check summaries of news articles for factual errors. A summary is "
                  "factually incorrect when it states something the article does not support. "
                  "Answer with one digit: 1 if the summary is factually incorrect, 0 if it is "
                  "factually consistent with the article."),
    query_template=("Article:\n{article}\n\nSummary:\n{summary}\n\nIs the summary factually "
                    "incorrect? Answer 1 (incorrect) or 0 (consistent)."),
    options=("0", "1"),
    positive="1",
    response_fields=("summary",),
    example_max_chars=700,
    descriptions={"0": "factually consistent (consistency >= 2.5)",
                  "1": "factually incorrect (consistency < 2.5)"},
)

LLMBAR_TASK = TaskSpec(
    name="llmbar",
    instructions=("You compare two responses to an instruction and pick the better one: the "
                  "one that follows the instruction more precisely and helpfully. Answer with "
                  "one letter: A or B."),
    query_template=("Instruction:\n{instruction}\n\nOutput (a):\n{output_1}\n\nOutput (b):\n"
                    "{output_2}\n\nWhich output is better? Answer A for output (a) or B for "
                    "output (b)."),
    options=("A", "B"),
    positive="A",
    response_fields=("output_1", "output_2"),
    example_max_chars=700,
    descriptions={"A": "output (a) is better (label 1)", "B": "output (b) is better (label 2)"},
    pair_fields=("output_1", "output_2"),
)

CUSTOM_INSTRUCTIONS = ("You judge whether a response answers a task correctly. Answer with one "
                       "digit: 1 if the response is correct, 0 if it is not.")
CUSTOM_QUERY = ("Task:\n{task}\n\nResponse:\n{response}\n\nIs the response correct? Answer 1 "
                "(correct) or 0 (incorrect).")
CUSTOM_EXAMPLE = "{query}\n\n(The expected correct answer here: {reference}.)"

SUMMEVAL_THRESHOLD = 2.5
"""A SummEval summary with expert consistency below this is factually incorrect."""


def default_path(task: str) -> Path:
    """The shared-data file of a built-in task."""
    if task == "summeval":
        return shared_data_dir() / "summeval" / "summeval.jsonl"
    if task == "llmbar":
        return shared_data_dir() / "llmbar" / "natural.json"
    raise ValueError(f"task {task!r} has no default data file; pass --data")


def load_summeval(path: str | os.PathLike | None = None) -> list[AuditRecord]:
    """SummEval rows as records (fields ``article``, ``summary``); truth ``"1"`` (incorrect)
    when the expert ``consistency`` is below :data:`SUMMEVAL_THRESHOLD`, else ``"0"``.

    Raises:
        RecordError: a row without a string article/summary or a numeric consistency.
        FileNotFoundError: no such file.
    """
    p = Path(path) if path is not None else default_path("summeval")
    out = []
    for i, (line, obj) in enumerate(read_json_objects(p)):
        art = field_of(obj, "article", str, path=p, line=line, index=i)
        summ = field_of(obj, "summary", str, path=p, line=line, index=i)
        cons = field_of(obj, "consistency", (int, float), path=p, line=line, index=i)
        if not summ.strip():
            raise RecordError(p, line, "summary", "empty summary", index=i)
        rid = f"{obj.get('article_id', line)}/{obj.get('summary_id', i)}"
        out.append(AuditRecord(rid, {"article": art, "summary": summ},
                               "1" if cons < SUMMEVAL_THRESHOLD else "0", line))
    return out


def load_llmbar(path: str | os.PathLike | None = None) -> list[AuditRecord]:
    """LLMBar items (a JSON array, or JSONL) as records (fields ``instruction``, ``output_1``,
    ``output_2``); truth ``"A"`` when the human label is 1, ``"B"`` when it is 2.

    Raises:
        InputError: not a JSON array of objects; an item without the fields, or another label
            (the message names the item and the field).
    """
    p = Path(path) if path is not None else default_path("llmbar")
    if not p.is_file():
        raise FileNotFoundError(f"no such input file: {p}")
    if p.suffix in (".jsonl", ".ndjson"):
        items = list(read_json_objects(p))
    else:
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(p, getattr(exc, "lineno", None), None,
                             f"not valid JSON ({exc})") from None
        if not isinstance(data, list):
            raise InputError(p, None, None, f"expected a JSON array of items, got "
                             f"{type(data).__name__}")
        items = [(i + 1, obj) for i, obj in enumerate(data)]
    out = []
    for i, (line, obj) in enumerate(items):
        if not isinstance(obj, dict):
            raise RecordError(p, line, None, f"item must be an object, got {type(obj).__name__}",
                              index=i)
        f = {k: field_of(obj, k, str, path=p, line=line, index=i)
             for k in ("input", "output_1", "output_2")}
        lab = field_of(obj, "label", (int, str), path=p, line=line, index=i)
        try:
            truth = label_truth(lab, ("A", "B"), {"1": "A", "2": "B"})
        except ValueError as exc:
            raise RecordError(p, line, "label", str(exc), index=i) from None
        out.append(AuditRecord(str(obj.get("id", line)), {"instruction": f["input"],
                               "output_1": f["output_1"], "output_2": f["output_2"]}, truth, line))
    return out


@dataclass
class CustomFields:
    """Field names and truth rule of a custom JSONL file.

    Attributes:
        task, response: fields with the task text and the response to judge.
        label: field with a human label (``str``/int, mapped through ``label_map``), or None.
        answer: field with the correct answer for the regular-expression truth, or None
            (exactly one of ``label`` / ``answer``).
        id: field with the record id (default: ``id`` when present, else the line number).
        pattern, normalisers: the regex truth's pattern (with ``{answer}``) and normalisation.
    """

    task: str = "x"
    response: str = "y"
    label: str | None = None
    answer: str | None = None
    id: str | None = None
    pattern: str = r"(?<!\w){answer}(?!\w)"
    normalisers: tuple[str, ...] = ("lower", "space", "strip")
    label_map: Mapping[str, str] | None = None


def custom_task(options: Sequence[str] = ("0", "1"), positive: str = "1",
                instructions: str | None = None, query_template: str | None = None,
                example_template: str | None = None, with_reference: bool = False
                ) -> TaskSpec:
    """The custom task: a correctness judgement with options ``0``/``1`` by default; the
    in-context examples restate the expected correct answer when the file has one."""
    ex = example_template or (CUSTOM_EXAMPLE if with_reference else "{query}")
    return TaskSpec(name="custom", instructions=instructions or CUSTOM_INSTRUCTIONS,
                    query_template=query_template or CUSTOM_QUERY, options=tuple(options),
                    positive=positive, response_fields=("response",), example_template=ex,
                    example_max_chars=1000)


def load_custom(path: str | os.PathLike, fields: CustomFields, options: Sequence[str] = ("0", "1"),
                correct: str = "1", incorrect: str = "0") -> list[AuditRecord]:
    """Records of a custom JSONL file: fields ``task``, ``response`` (and ``reference`` when an
    answer field is used); truth from the label field, or ``correct`` / ``incorrect`` from the
    regular-expression match of the response against the answer field.

    Raises:
        RecordError: a missing or non-string field, a label that is not an option, a duplicate id.
        ValueError: neither or both of ``label`` / ``answer``.
    """
    if (fields.label is None) == (fields.answer is None):
        raise ValueError("give exactly one truth source: a label field or an answer field")
    p = Path(path)
    out, seen = [], {}
    for i, (line, obj) in enumerate(read_json_objects(p)):
        task = field_of(obj, fields.task, str, path=p, line=line, index=i)
        resp = field_of(obj, fields.response, str, path=p, line=line, index=i)
        if not resp.strip():
            raise RecordError(p, line, fields.response, "empty response (nothing to judge)",
                              index=i)
        f = {"task": task, "response": resp}
        if fields.label is not None:
            lab = field_of(obj, fields.label, (str, int, float, bool), path=p, line=line, index=i)
            try:
                truth = label_truth(lab, options, fields.label_map)
            except ValueError as exc:
                raise RecordError(p, line, fields.label, str(exc), index=i) from None
        else:
            ans = field_of(obj, fields.answer, (str, int, float), path=p, line=line, index=i)
            ans = str(ans)
            try:
                truth = regex_truth(resp, ans, pattern=fields.pattern,
                                    normalisers=fields.normalisers, correct=correct,
                                    incorrect=incorrect)
            except ValueError as exc:
                raise InputError(p, line, fields.answer, str(exc)) from None
            f["reference"] = ans
        if fields.id is not None:
            rid = field_of(obj, fields.id, (str, int), path=p, line=line, index=i)
        else:
            rid = obj.get("id", line)
        rid = str(rid)
        if rid in seen:
            raise RecordError(p, line, fields.id or "id", f"duplicate id {rid!r} (first on line "
                              f"{seen[rid]})", index=i)
        seen[rid] = line
        out.append(AuditRecord(rid, f, truth, line))
    return out


# --------------------------------------------------------------------------- limit and split


def spread(records: Sequence[AuditRecord], limit: int | None, seed: int = 0,
           balance: bool = False) -> list[AuditRecord]:
    """An even, seeded spread of ``limit`` records over the data, in file order: the data is
    cut into ``limit`` equal strata and one record is drawn from each (so a quick run sees the
    whole file, not its head). With ``balance`` the limit is shared equally between the truth
    classes (each spread evenly over its own records), for data sets where one class is rare
    (SummEval: 117 of 1600 summaries are incorrect). ``None`` or a limit >= the size: all."""
    recs = list(records)
    if limit is None:
        return recs
    if not isinstance(limit, int) or limit < 2:
        raise ValueError(f"--limit must be an integer >= 2, got {limit!r}")
    rng = random.Random(seed)
    if balance:
        classes = sorted({r.truth for r in recs})
        groups = [[i for i, r in enumerate(recs) if r.truth == c] for c in classes]
        share = [limit // len(groups) + (k < limit % len(groups)) for k in range(len(groups))]
        picked = sorted(j for g, s in zip(groups, share, strict=True) for j in _strata(g, s, rng))
    else:
        picked = _strata(list(range(len(recs))), limit, rng)
    return [recs[i] for i in picked]


def _strata(idx: list[int], n: int, rng: random.Random) -> list[int]:
    if n >= len(idx):
        return list(idx)
    out = []
    for k in range(n):
        lo, hi = k * len(idx) // n, (k + 1) * len(idx) // n
        out.append(idx[rng.randrange(lo, hi)])
    return out


def split(records: Sequence[AuditRecord], heldout: float = 0.5, seed: int = 0
          ) -> tuple[list[AuditRecord], list[AuditRecord]]:
    """Seeded train / held-out split, stratified by truth (each class split in the same
    proportion), both parts in the input order. The held-out part is what every reported
    number is measured on; it never enters the memory.

    Raises:
        ValueError: ``heldout`` outside (0, 1), or a split that leaves a part empty.
    """
    if not 0.0 < heldout < 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1), got {heldout}")
    rng = random.Random(seed + 7919)  # a stream of its own, apart from the limit's
    held: set[int] = set()
    for c in sorted({r.truth for r in records}):
        idx = [i for i, r in enumerate(records) if r.truth == c]
        rng.shuffle(idx)
        held.update(idx[:round(heldout * len(idx))])
    train = [r for i, r in enumerate(records) if i not in held]
    test = [r for i, r in enumerate(records) if i in held]
    if not train or not test:
        raise ValueError(f"{len(records)} records leave an empty train or held-out split; use "
                         "more records (--limit)")
    return train, test


def load_task(task: str, path: str | os.PathLike | None, /, **custom: Any
              ) -> tuple[TaskSpec, list[AuditRecord]]:
    """The task spec and all records of ``task`` (``summeval``, ``llmbar`` or ``custom``; the
    custom keyword arguments go to :class:`CustomFields` / :func:`custom_task`)."""
    if task == "summeval":
        return SUMMEVAL_TASK, load_summeval(path)
    if task == "llmbar":
        return LLMBAR_TASK, load_llmbar(path)
    if task == "custom":
        if path is None:
            raise ValueError("--task custom needs --data FILE")
        options = tuple(custom.pop("options", ("0", "1")))
        positive = custom.pop("positive", options[-1])
        spec_kw = {k: custom.pop(k) for k in ("instructions", "query_template",
                                              "example_template") if k in custom}
        fields = CustomFields(**custom)
        recs = load_custom(path, fields, options, correct=positive,
                           incorrect=[o for o in options if o != positive][0])
        return custom_task(options, positive, with_reference=fields.answer is not None,
                           **spec_kw), recs
    raise ValueError(f"unknown task {task!r}; use summeval, llmbar or custom")
