"""Loaders of the public evaluation data sets (read from ``../shared/data`` or a given path),
and their registry: :data:`EVAL_DATASETS`, one :class:`EvalDataset` entry per ``icqs-fast eval``
data set (its default file, task kind, metrics and reader), which ``eval``, the study and its
plots read instead of branching on the name. Adding a data set of a known kind is one entry.
"""

from __future__ import annotations

import csv
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from icqs_fast.io.readers import read_json_objects
from icqs_fast.io.records import InputError, PathLike, Record, RecordError, field_of

# ChaosNLI's label letters.
NLI_GROUPS = {"e": "entailment", "n": "neutral", "c": "contradiction"}

# --------------------------------------------------------------------------- real data


def shared_data_dir() -> Path:
    """The read-only real-data folder: ``$ICQS_FAST_SHARED_DATA``, else ``../shared/data``
    next to the repository (or the current folder)."""
    env = os.environ.get("ICQS_FAST_SHARED_DATA")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    for root in (repo, Path.cwd()):
        cand = root.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return repo.parent / "shared" / "data"


def default_fpb_path() -> Path:
    """Financial PhraseBank's default file (the registry's ``fpb`` entry)."""
    return eval_dataset("fpb").default_path()


FPB_LABELS = ("positive", "negative", "neutral")


def read_fpb(path: PathLike | None = None) -> Iterator[Record]:
    """Stream Financial PhraseBank ``sentence@label`` lines as :class:`Record` s (x = sentence,
    y = label). The file is decoded as UTF-8, or Latin-1 when it is not valid UTF-8 (the
    original release is Latin-1).

    Raises:
        FileNotFoundError: no file (by default ``../shared/data/fpb/Sentences_AllAgree.txt``).
        InputError: a line without ``@label`` or with an unknown label.
    """
    p = Path(path) if path is not None else default_fpb_path()
    if not p.is_file():
        raise FileNotFoundError(f"Financial PhraseBank file not found: {p}")
    return _fpb(p)


def _fpb(p: Path) -> Iterator[Record]:
    with open(p, "rb") as f:
        index = 0
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            text = text.strip().lstrip("\ufeff")
            if not text:
                continue
            sentence, sep, label = text.rpartition("@")
            if not sep:
                raise InputError(p, lineno, "label", "no '@label' at the end of the line")
            label = label.strip().lower()
            if label not in FPB_LABELS:
                raise InputError(p, lineno, "label",
                                 f"unknown label {label!r} (expected {', '.join(FPB_LABELS)})")
            sentence = sentence.strip()
            if not sentence:
                raise InputError(p, lineno, "sentence", "empty sentence")
            yield Record(index=index, line=lineno, x=sentence, y=label, label=label)
            index += 1


_FLIP = {"positive": "negative", "negative": "positive"}


def fpb_examples(
    path: PathLike | None = None,
    *,
    n_good: int = 32,
    n_bad: int = 32,
    seed: int = 0,
    max_chars: int | None = 200,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[Record]]:
    """Good and bad ICQS demonstrations from Financial PhraseBank, plus the unused sentences.

    Good demonstrations are positive/negative sentences with their own label; bad ones are other
    positive/negative sentences with the opposite label (the ICQS paper's setup). Neutral
    sentences are never demonstrations; they stay in the returned rest, for scoring.

    Args:
        n_good, n_bad: pool sizes (each drawn from distinct sentences, half positive and half
            negative where possible).
        seed: sampling seed.
        max_chars: only sentences up to this length are drawn as demonstrations (short prompts).

    Returns:
        ``(good, bad, rest)``: two lists of (sentence, label) pairs and the remaining records.
    """
    rows = list(read_fpb(path))
    rng = random.Random(seed)
    polar = [r for r in rows if r.y in _FLIP and (max_chars is None or len(r.x) <= max_chars)]
    by_label = {lab: [r for r in polar if r.y == lab] for lab in _FLIP}
    for lst in by_label.values():
        rng.shuffle(lst)
    need = n_good + n_bad
    if len(polar) < need:
        raise ValueError(f"only {len(polar)} usable positive/negative sentences, need {need}")
    # Alternate labels so both pools are balanced while the data allow.
    order: list[Record] = []
    pos, neg = by_label["positive"], by_label["negative"]
    while len(order) < need:
        for lst in (pos, neg):
            if lst and len(order) < need:
                order.append(lst.pop())
    good_recs, bad_recs = order[:n_good], order[n_good:need]
    used = {r.index for r in good_recs} | {r.index for r in bad_recs}
    good = [(r.x, r.y) for r in good_recs]
    bad = [(r.x, _FLIP[r.y]) for r in bad_recs]
    rest = [r for r in rows if r.index not in used]
    return good, bad, rest


def read_sst2(path: PathLike) -> list[tuple[int, str, str]]:
    """SST-2 TSV rows (``sentence<TAB>label``, header row, 1 = positive, 0 = negative) as
    ``(line, sentence, "positive"|"negative")``.

    Raises:
        FileNotFoundError: no file.
        InputError: a missing header column, a row without two fields, an empty sentence or a
            label other than 0/1, naming the file, line and field.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"SST-2 file not found: {p}")
    out = []
    with open(p, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None:
            raise InputError(p, None, None, "empty file (expected a 'sentence<TAB>label' header)")
        cols = [h.strip() for h in header]
        for need in ("sentence", "label"):
            if need not in cols:
                raise InputError(p, 1, need, f"no {need!r} column in the header {cols}")
        i_s, i_l = cols.index("sentence"), cols.index("label")
        for lineno, row in enumerate(rows, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) <= max(i_s, i_l):
                raise InputError(p, lineno, "label" if len(row) > i_s else "sentence",
                                 f"{len(row)} field(s), expected {len(cols)}")
            sentence, lab = row[i_s].strip(), row[i_l].strip()
            if not sentence:
                raise InputError(p, lineno, "sentence", "empty sentence")
            if lab not in ("0", "1"):
                raise InputError(p, lineno, "label", f"expected 0 or 1, got {lab!r}")
            out.append((lineno, sentence, "positive" if lab == "1" else "negative"))
    return out


@dataclass(frozen=True)
class NLIItem:
    """One ChaosNLI pair: premise, hypothesis, the human distribution ``[e, n, c]`` (sums to 1)
    and the majority label ("e", "n" or "c")."""

    uid: str
    premise: str
    hypothesis: str
    label_dist: tuple[float, float, float]
    majority: str


def read_chaosnli(path: PathLike) -> list[NLIItem]:
    """ChaosNLI JSONL (``uid``, ``label_dist`` = [e, n, c], ``majority_label``,
    ``example.premise``, ``example.hypothesis``).

    Raises:
        FileNotFoundError: no file.
        InputError: invalid JSON or a missing / malformed field, naming the file, line and field.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ChaosNLI file not found: {p}")
    out = []
    for i, (line, obj) in enumerate(read_json_objects(p)):
        def get(f: str, kind: Any, line: int = line, obj: dict = obj, i: int = i) -> Any:
            return field_of(obj, f, kind, path=p, line=line, index=i)

        dist = get("label_dist", list)
        if len(dist) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                     and v >= 0 for v in dist):
            raise InputError(p, line, "label_dist", f"expected 3 non-negative numbers, got {dist}")
        s = float(sum(dist))
        if not abs(s - 1.0) < 1e-3:
            raise InputError(p, line, "label_dist", f"sums to {s:g}, expected 1")
        maj = get("majority_label", str)
        if maj not in NLI_GROUPS:
            raise InputError(p, line, "majority_label", f"expected e, n or c, got {maj!r}")
        prem, hyp = get("example.premise", str).strip(), get("example.hypothesis", str).strip()
        for name, v in (("example.premise", prem), ("example.hypothesis", hyp)):
            if not v:
                raise InputError(p, line, name, "empty text")
        out.append(NLIItem(str(get("uid", str)), prem, hyp,
                           tuple(float(v) / s for v in dist), maj))  # type: ignore[arg-type]
    if not out:
        raise InputError(p, None, None, "no records")
    return out


def _read_jsonl(path: Path) -> list[tuple[int, int, dict[str, Any]]]:
    """``(index, line, object)`` per record; errors name the file, line and field."""
    return [(i, line, obj) for i, (line, obj) in enumerate(read_json_objects(path))]


def _turns(path: Path, i: int, line: int, obj: dict, field: str) -> list[str]:
    turns = field_of(obj, field, list, path=path, line=line, index=i)
    for t, text in enumerate(turns):
        if not isinstance(text, str):
            raise RecordError(path, line, f"{field}.{t}",
                              f"must be str, got {type(text).__name__}", index=i)
    return turns


def _by_question(path: Path, field: str) -> dict[int, tuple[list[str], int]]:
    """question_id -> (turns, line) of a question / answer / reference file."""
    out = {}
    for i, line, obj in _read_jsonl(path):
        qid = field_of(obj, "question_id", int, path=path, line=line, index=i)
        out[qid] = (_turns(path, i, line, obj, field), line)
    return out


def load_mtbench(data: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Judged MT-Bench answers as records ``{question_id, model, turn, score, item}``, where
    ``item`` is a dict for :func:`icqs_fast.features.glassbox` (with ``history`` for turn 2 and
    ``reference`` when a GPT-4 reference answer exists).

    Records are sorted by (question_id, turn, model). ``limit`` keeps ``limit`` records spread
    evenly over that order (so every category is represented), not the first ``limit``.

    Every file is read whole before anything is scored, and any problem (invalid JSON, a missing
    or mistyped field, a judgment of a question or answer that is not there) raises
    :class:`icqs_fast.io.records.InputError` naming the file, line and field. An empty answer is a
    valid record (the real data has one, judged by GPT-4); its features are NaN.
    """
    root = Path(data)
    qfile = root / "question.jsonl"
    jfile = root / "judgment_gpt-4_single.jsonl"
    for f in (qfile, jfile):
        if not f.exists():
            raise FileNotFoundError(f"MT-Bench file {f} not found (pass --data FOLDER)")
    questions = _by_question(qfile, "turns")
    refs: dict[int, tuple[list[str], int]] = {}
    rfile = root / "reference_answer_gpt-4.jsonl"
    if rfile.exists():
        refs = _by_question(rfile, "choices.0.turns")
    answers: dict[str, dict[int, tuple[list[str], int]]] = {}
    recs = []
    for i, line, j in _read_jsonl(jfile):
        def need(field, kind, j=j, i=i, line=line):
            return field_of(j, field, kind, path=jfile, line=line, index=i)

        score = float(need("score", (int, float)))
        if score < 1:
            continue
        model = need("model", str)
        qid, turn = need("question_id", int), need("turn", int)
        if turn not in (1, 2):
            raise RecordError(jfile, line, "turn", f"must be 1 or 2, got {turn}", index=i)
        if model not in answers:
            afile = root / f"model_answer_{model}.jsonl"
            if not afile.exists():
                raise FileNotFoundError(f"answers of {model!r} not found: {afile} (needed by "
                                        f"{jfile}:{line})")
            answers[model] = _by_question(afile, "choices.0.turns")
        if qid not in questions:
            raise RecordError(jfile, line, "question_id", f"no question {qid} in {qfile}",
                              index=i)
        if qid not in answers[model]:
            raise RecordError(jfile, line, "question_id",
                              f"model {model!r} has no answer to question {qid}", index=i)
        (q, qline), (a, aline) = questions[qid], answers[model][qid]
        for f, turns, fline, field in ((qfile, q, qline, "turns"),
                                       (root / f"model_answer_{model}.jsonl", a, aline,
                                        "choices.0.turns")):
            if len(turns) < turn:
                raise RecordError(f, fline, field, f"{len(turns)} turn(s), but {jfile}:{line} "
                                  f"judges turn {turn}", index=i)
        ref = refs.get(qid, (None, 0))[0]
        item: dict[str, Any] = {"instruction": q[turn - 1], "response": a[turn - 1],
                                "reference": ref[turn - 1] if ref and len(ref) >= turn else None}
        if turn == 2:
            item["history"] = [(q[0], a[0])]
        recs.append({"question_id": qid, "model": model, "turn": turn, "score": score,
                     "item": item})
    recs.sort(key=lambda r: (r["question_id"], r["turn"], r["model"]))
    if limit is not None and 0 < limit < len(recs):
        n = len(recs)
        recs = [recs[(i * n) // limit] for i in range(limit)]
    return recs


# --------------------------------------------------------------------------- the registry


def fpb_rows(path: PathLike | None = None) -> list[tuple[str, str]]:
    """Financial PhraseBank as ``(sentence, label)`` pairs (:func:`read_fpb`)."""
    return [(r.x, r.y) for r in read_fpb(path)]


def sst2_rows(path: PathLike) -> list[tuple[str, str]]:
    """SST-2 as ``(sentence, "positive"|"negative")`` pairs (:func:`read_sst2`)."""
    return [(x, y) for _, x, y in read_sst2(path)]


KINDS = {
    "labels": "labelled sentences; responses correct or not by their label (accuracy per group, "
              "AUC correct vs incorrect)",
    "distributions": "pairs with human label distributions (MAE, CE, Spearman against them)",
    "judgments": "answers with a judge's scores (correlation of features with the scores)",
}
"""The task kinds of the evaluation data sets: what a study of each compares."""


@dataclass(frozen=True)
class EvalDataset:
    """One evaluation data set: the ``icqs-fast eval NAME`` subcommand.

    Attributes:
        name: the subcommand and the documents' ``"dataset"``.
        title: its name in printed tables and figure titles.
        help: the subcommand's one-line help.
        default: its default file (or folder), relative to :func:`shared_data_dir`, POSIX
            separators; the first part is the data set's own subfolder.
        kind: one of :data:`KINDS`.
        metrics: what the study reports per method.
        read: its reader: a path to the records the study of its kind takes (``labels``:
            ``(sentence, label)`` pairs; ``distributions``: :class:`NLIItem`; ``judgments``:
            :func:`load_mtbench`'s records).
        neutral: ``labels`` only: it has a neutral class (the labeled_neutral /
            semantic_neutral groups, and "neutral" among ICL's candidates).
        subject: ``labels`` only: what a sentence is, in the Ask LLM question.
    """

    name: str
    title: str
    help: str
    default: str
    kind: str
    metrics: tuple[str, ...]
    read: Callable[..., Any]
    neutral: bool = False
    subject: str = ""

    def default_path(self) -> Path:
        """The default file or folder, under :func:`shared_data_dir` (read at each call, so
        ``$ICQS_FAST_SHARED_DATA`` set later is honoured)."""
        return shared_data_dir().joinpath(*PurePosixPath(self.default).parts)

    @property
    def file_name(self) -> str:
        """The default file's (or folder's) own name, looked for in a ``--data`` folder."""
        return PurePosixPath(self.default).name

    @property
    def folder(self) -> str:
        """The data set's subfolder of the shared data folder."""
        return PurePosixPath(self.default).parts[0]


EVAL_DATASETS: dict[str, EvalDataset] = {d.name: d for d in (
    EvalDataset("mtbench", "MT-Bench", "glass-box features vs GPT-4 on MT-Bench", "mtbench",
                "judgments", ("pearson", "spearman", "kendall"), load_mtbench),
    EvalDataset("fpb", "Financial PhraseBank (all agree)", "ICQS study on Financial PhraseBank",
                "fpb/Sentences_AllAgree.txt", "labels", ("accuracy", "auc"), fpb_rows,
                neutral=True, subject="financial news sentence"),
    EvalDataset("sst2", "SST-2 dev", "ICQS study on SST-2", "sst2/dev.tsv", "labels",
                ("accuracy", "auc"), sst2_rows, subject="movie review sentence"),
    EvalDataset("chaosnli", "ChaosNLI-SNLI", "ICQS study on ChaosNLI distributions",
                "chaosnli/chaosNLI_snli.jsonl", "distributions", ("mae", "ce", "spearman"),
                read_chaosnli),
)}
"""Every ``icqs-fast eval`` data set, by name (the subcommands, in this order)."""


def eval_dataset(name: str) -> EvalDataset:
    """The registry's entry ``name``; ValueError naming the known ones otherwise."""
    try:
        return EVAL_DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown evaluation data set {name!r}; one of "
                         f"{', '.join(EVAL_DATASETS)}") from None


def eval_datasets(kind: str | None = None) -> list[EvalDataset]:
    """The registry's entries (of ``kind`` when given), in order."""
    return [d for d in EVAL_DATASETS.values() if kind is None or d.kind == kind]
