"""The ICQS study of each kind of evaluation data set: how ``icqs-fast eval`` loads, runs,
documents, prints and pools a data set, by the ``kind`` of its registry entry
(:data:`icqs_fast.io.datasets.EVAL_DATASETS`), so no caller branches on a data set's name.

* ``labels`` (FPB, SST-2): the sentiment study of :mod:`icqs_fast.evals.study` (groups of
  responses correct or not by their label; accuracy, AUC).
* ``distributions`` (ChaosNLI): the NLI study (distributions read from the scores against the
  human ones; MAE, CE, Spearman).

(``judgments``, MT-Bench, is the glass-box feature evaluation of ``eval mtbench``, not an ICQS
study.) A new data set of one of these kinds is one registry entry; a new kind is one entry
here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icqs_fast.engine.prompts import Template
from icqs_fast.evals.calibration_study import (
    compare_table,
    nli_compare_table,
    plot_pooled,
    plot_pooled_nli,
    pool,
    pool_nli,
)
from icqs_fast.evals.study_report import distribution_report, label_report
from icqs_fast.io.datasets import EvalDataset, eval_dataset

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class StudyKind:
    """What differs between the studies of two kinds of data set.

    Attributes:
        kind: the registry kind.
        load: ``(ds, path, *, pool, limit, seed, labels) -> data`` (pools and test items).
        run: ``(model, tok, data, settings) -> out`` (:mod:`icqs_fast.evals.study`).
        document: ``(out, *, ds, model, seconds, st, labels) -> doc`` (the ``--json``
            document).
        report: ``(doc, path, ds) -> str`` (the printed table).
        responses: ``data -> (template, good, bad, responses, groups)``: what the engine scores
            (``--stability``); ``groups``: group -> its responses, {} without groups.
        pool, plot_pooled, compare_table: ``--pool-json``'s pooling of ``--compare``
            documents (:mod:`icqs_fast.evals.calibration_study`), its figure and its table.
        pooled_size: ``(pooled, settings) -> str``, what the pooled header says of the sample.
        pooled_suffix: ``settings -> str``, the pooled figure's file-name suffix.
        per_run_metric: the ICQS-Epistemic metric printed per pooled run.
        label_options: whether ``--labels synonyms`` and ``--stratify`` apply.
        needs_items: whether pooling needs the documents' per-item predictions.
    """

    kind: str
    load: Callable[..., Any]
    run: Callable[..., dict[str, Any]]
    document: Callable[..., dict[str, Any]]
    report: Callable[[dict[str, Any], Path, EvalDataset], str]
    responses: Callable[[Any], tuple[Any, list, list, list, dict[str, list]]]
    pool: Callable[..., dict[str, Any]]
    plot_pooled: Callable[[dict[str, dict[str, Any]], str], str]
    compare_table: Callable[[dict[str, Any]], str]
    pooled_size: Callable[[dict[str, Any], dict[str, Any]], str]
    pooled_suffix: Callable[[dict[str, Any]], str]
    per_run_metric: str
    label_options: bool
    needs_items: bool


# --------------------------------------------------------------------------- labels


def _load_labels(ds: EvalDataset, path: Path | None, *, pool: int, limit: int | None,
                 seed: int, labels: str) -> Any:
    from icqs_fast.evals.study_data import sentiment_data

    return sentiment_data(ds, path, pool=pool, limit=limit, seed=seed, labels=labels)


def _run_labels(model: PreTrainedModel, tok: PreTrainedTokenizerBase, data: Any,
                st: Any) -> dict[str, Any]:
    from icqs_fast.evals.study import run_sentiment

    return run_sentiment(model, tok, data, st)


def _document_labels(out: dict[str, Any], *, ds: EvalDataset, model: str, seconds: float,
                     st: Any, labels: str) -> dict[str, Any]:
    from icqs_fast.evals.study import sentiment_json

    return sentiment_json(out, dataset=ds.name, model=model, seconds=seconds, st=st,
                          labels=labels)


def _label_responses(data: Any) -> tuple[Any, list, list, list, dict[str, list]]:
    groups = {g: [(r.x, r.y) for r in rs] for g, rs in data.groups.items()}
    responses = list(dict.fromkeys(xy for rs in groups.values() for xy in rs))
    return None, data.good, data.bad, responses, groups


# --------------------------------------------------------------------------- distributions


def _load_distributions(ds: EvalDataset, path: Path | None, *, pool: int, limit: int | None,
                        seed: int, labels: str) -> Any:
    from icqs_fast.evals.study_data import chaosnli_data

    return chaosnli_data(path, pool=pool, limit=limit, seed=seed, dataset=ds)


def _run_distributions(model: PreTrainedModel, tok: PreTrainedTokenizerBase, data: Any,
                       st: Any) -> dict[str, Any]:
    from icqs_fast.evals.study import run_chaosnli

    return run_chaosnli(model, tok, data, st)


def _document_distributions(out: dict[str, Any], *, ds: EvalDataset, model: str,
                            seconds: float, st: Any, labels: str) -> dict[str, Any]:
    from icqs_fast.evals.study import chaosnli_json

    return chaosnli_json(out, model=model, seconds=seconds, st=st, dataset=ds.name)


def _pair_responses(data: Any) -> tuple[Any, list, list, list, dict[str, list]]:
    from icqs_fast.evals.study import NLI_ICQS_TEMPLATE

    good = [(it.premise, it.hypothesis) for it in data.good]
    bad = [(it.premise, it.hypothesis) for it in data.bad]
    responses = [(it.premise, it.hypothesis) for it in data.test]
    return Template(**NLI_ICQS_TEMPLATE), good, bad, responses, {}


STUDY_KINDS: dict[str, StudyKind] = {
    "labels": StudyKind(
        "labels", _load_labels, _run_labels, _document_labels, label_report,
        _label_responses, pool, plot_pooled, compare_table,
        pooled_size=lambda cmp, s: f"stratify {s.get('stratify')}",
        pooled_suffix=lambda s: "_stratified" if s.get("stratify") else "_unstratified",
        per_run_metric="AUC", label_options=True, needs_items=False),
    "distributions": StudyKind(
        "distributions", _load_distributions, _run_distributions, _document_distributions,
        distribution_report, _pair_responses, pool_nli, plot_pooled_nli, nli_compare_table,
        pooled_size=lambda cmp, s: f"{cmp['n']} items", pooled_suffix=lambda s: "",
        per_run_metric="Spearman", label_options=False, needs_items=True),
}
"""The study of each registry kind that ``icqs-fast eval`` runs as an ICQS study."""


def study_of(dataset: str | EvalDataset) -> tuple[EvalDataset, StudyKind]:
    """A data set's registry entry and the study of its kind (ValueError for a data set that is
    not an ICQS study, e.g. ``mtbench``)."""
    ds = dataset if isinstance(dataset, EvalDataset) else eval_dataset(dataset)
    if ds.kind not in STUDY_KINDS:
        raise ValueError(f"{ds.name} ({ds.kind}) is not an ICQS study data set; the studies "
                         f"run {', '.join(STUDY_KINDS)} data sets")
    return ds, STUDY_KINDS[ds.kind]
