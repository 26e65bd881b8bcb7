"""``icqs-fast score``: ICQS scores for the responses of a file, streamed to JSONL or Parquet.

    icqs-fast score responses.jsonl -o scores.jsonl --good good.jsonl --bad bad.jsonl

Input: JSONL, CSV, TSV (optionally .gz), Parquet, or a Hugging Face ``datasets`` folder
(``save_to_disk``), read in a stream (see :func:`icqs_fast.io.readers.read_records`). Output:
JSONL, or
Parquet for ``-o OUT.parquet`` (committed in part files, merged into one file on close; see
:class:`icqs_fast.io.results.ParquetResultWriter` for what a crash keeps: at most the last
uncommitted part is computed again on ``--resume``). ``--shard i/n`` scores only the i-th
(0-based) of n contiguous ranges of input records: the n outputs concatenated in shard order
are the unsharded output (docs/scoring_files.md). A progress bar (or, when stderr is not a
terminal, a status line every 10 s) shows records/s and the ETA; ``--quiet`` turns it off.

Each response gets one output line as soon as it is scored (one ``write`` per line), so a run
that stops - a bad input line, Ctrl-C, SIGKILL, a power cut - keeps everything computed so far,
and ``--resume`` continues after the last written record without redoing or duplicating any (a
line cut off mid-write is truncated away and redone). One process at a time writes an output:
it holds an advisory lock on ``OUT.lock`` and a second one refuses at once, naming the holder's
pid. A bad input line stops the run with an error naming the file, line and field
(``--on-error stop``, the default) or is reported on stderr and recorded in the output as a
``{"index", "line", "error": {"field", "reason"}}`` line (``--on-error skip``).

Output record fields: ``index`` (0-based record number in the input; bad records count too),
``line``, ``id`` (when the input has one), ``label`` (with ``--label-field``), ``score``
(ICQS-Epistemic), ``score_per_set`` (plain ICQS per set), ``loglik`` (``[M+1][L]``),
``ratios``, ``n_response_tokens``, ``n_prompt_tokens`` (``[M+1][L]``), when demonstrations
had to be dropped ``n_dropped_demos``, then ``truncated`` (demonstrations were dropped) and
``join`` (the response's first token merges with the query under whole-text tokenization).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.io.readers import read_examples, read_pool_pairs, read_rows
from icqs_fast.io.records import InputError, Record, RecordError
from icqs_fast.io.runs import resumed_dtype, resumed_meta
from icqs_fast.io.schema import arrow_schema, icqs_row
from icqs_fast.jobs.config import ON_ERROR, ScoreJobConfig
from icqs_fast.models import runtime_settings
from icqs_fast.options import declaration

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from icqs_fast.engine.scorer import ICQSScorer

__all__ = ["ON_ERROR", "DemoSets", "ScoreStrategy", "Summary", "check_record", "load_template",
           "ordered_results", "output_summary", "score_records"]


# --------------------------------------------------------------------------- library part


def check_record(scorer: ICQSScorer, rec: Record, *, path: str = "<input>", x_field: str = "x",
                 y_field: str = "y") -> RecordError | None:
    """What the scorer would reject in ``rec`` (before it is sent to the scorer), or None.

    ``rec`` is a record of the reader (:func:`~icqs_fast.io.readers.read_records`), which has
    already checked its fields (x and y strings, y not blank): here only what needs the
    scorer's tokenizer and template - query and response giving tokens, every context's prompt
    within the max length - through its ``tokens`` (cached there, so the engine does not
    tokenize the record again), ``max_length`` and ``drop_oldest_demos``. Checking here means
    the error is built for this record by construction, with its index, line and field,
    instead of being recovered from the scorer's message text.
    """
    from icqs_fast.engine.prompt_tokens import EmptyPart, PromptTooLong

    def err(field: str | None, reason: str) -> RecordError:
        return RecordError(path, rec.line, field, reason, index=rec.index)

    tokens = scorer.tokens
    try:
        tokens.response_parts(rec.index, rec.x, rec.y)
        tokens.layouts(rec.index, rec.x, rec.y, scorer.max_length, scorer.drop_oldest_demos)
    except EmptyPart as exc:
        return err(x_field if exc.part == "x" else y_field, exc.reason)
    except PromptTooLong as exc:
        # The engine names its keyword; a job's reader knows the option by its flag.
        drop = declaration(ScoringSettings, "drop_oldest_demos").flag
        longer = declaration(ScoringSettings, "max_length").flag
        return err(None, exc.reason.replace("drop_oldest_demos=True",
                                            f"drop_oldest_demos=True ({drop})")
                   .replace("raise the max length", f"raise {longer}"))
    except ValueError as exc:
        return err(None, str(exc))
    return None


def score_records(
    scorer: ICQSScorer,
    records: Iterable[Record | RecordError],
    *,
    path: str = "<input>",
    x_field: str = "x",
    y_field: str = "y",
    on_error: Callable[[RecordError], None] | None = None,
) -> Iterator[tuple[Record, Any]]:
    """Score :class:`~icqs_fast.io.records.Record` s with an
    :class:`~icqs_fast.engine.scorer.ICQSScorer`,
    yielding ``(record, result)`` in input order, lazily.

    ``records`` may also hold :class:`RecordError` s in place of bad records (``read_records(...,
    on_error="yield")``); a record the scorer would reject (see :func:`check_record`) becomes
    one too. With ``on_error`` each is passed there - in input order, interleaved with the
    yielded results, so a caller writing both keeps the file order - and scoring goes on.
    Without, every record before the first bad one (or before an :class:`InputError` the
    ``records`` iterator raises) is still scored and yielded, then the error is raised.
    """
    return ordered_results(
        records, lambda r: check_record(scorer, r, path=path, x_field=x_field, y_field=y_field),
        lambda r: (r.x, r.y), scorer.score, on_error)


def ordered_results(records: Iterable[Any], check: Callable[[Any], RecordError | None],
                    item: Callable[[Any], Any], compute: Callable[[Iterable[Any]], Iterable[Any]],
                    on_error: Callable[[RecordError], None] | None = None
                    ) -> Iterator[tuple[Any, Any]]:
    """The loop of :func:`score_records` for any record kind: ``records`` (and
    :class:`RecordError` s in their place) checked by ``check`` (its error, or None), each good
    one's ``item`` fed to ONE ``compute`` stream (a scorer's ``score``, or a pair judge), and
    ``(record, result)`` yielded in input order, bad records passed to ``on_error`` in their
    place or raised after the results before them (see :func:`score_records`)."""
    source = iter(records)
    queue: deque[Any] = deque()  # fed records and errors, in input order
    fatal: list[InputError] = []

    def feed() -> Iterator[Any]:
        while not fatal:
            try:
                rec = next(source)
            except StopIteration:
                return
            except InputError as exc:
                fatal.append(exc)  # end the stream; what came before is still scored
                return
            if not isinstance(rec, RecordError):
                bad = check(rec)
                if bad is None:
                    queue.append(rec)
                    yield item(rec)
                    continue
                rec = bad
            if on_error is None:
                fatal.append(rec)
                return
            queue.append(rec)

    for res in compute(feed()):
        while isinstance(queue[0], RecordError):
            on_error(queue.popleft())
        yield queue.popleft(), res
    while queue:  # only errors are left
        on_error(queue.popleft())
    if fatal:
        raise fatal[0]


class Summary:
    """Running count, mean score (overall and per label) and throughput."""

    def __init__(self, with_label: bool = False, notes: Iterable[str] = ()) -> None:
        self.with_label = with_label
        self.notes = list(notes)  # lines said after the counts (the self-check's verdict)
        self.n = 0
        self.total = 0.0
        self.by_label: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.skipped = 0
        self.t0 = time.perf_counter()

    def add(self, rec: Record, res: Any) -> None:
        score, label = res.score, rec.label
        self.n += 1
        self.total += score
        if self.with_label:
            s = self.by_label[json.dumps(label) if not isinstance(label, str) else label]
            s[0] += 1
            s[1] += score

    def text(self, prefix: str = "") -> str:
        dt = time.perf_counter() - self.t0
        mean = f"{self.total / self.n:.4f}" if self.n else "n/a"
        rate = self.n / dt if dt > 0 else 0.0
        parts = [f"{prefix}scored {self.n} responses in {dt:.1f} s ({rate:.2f} responses/s)",
                 f"mean score {mean}"]
        if self.skipped:
            parts.append(f"{self.skipped} bad records skipped")
        line = ", ".join(parts)
        if self.by_label:
            line += "\n  mean score by label: " + ", ".join(
                f"{k}: {v[1] / v[0]:.4f} (n={v[0]})" for k, v in sorted(self.by_label.items()))
        return "\n  ".join([line, *self.notes])


def load_template(path: str | None):
    from icqs_fast.engine.prompts import Template

    if path is None:
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except json.JSONDecodeError as exc:
        raise InputError(path, exc.lineno, None, f"invalid JSON ({exc.msg})") from None
    if not isinstance(spec, dict):
        raise InputError(path, None, None, "a template file holds a JSON object")
    unknown = sorted(set(spec) - {"system", "demo", "query", "response", "separator"})
    if unknown:
        raise InputError(path, None, unknown[0], "unknown Template field")
    return Template(**spec), spec


def checked_runtime(model: PreTrainedModel, backend: str) -> dict:
    """:func:`~icqs_fast.models.runtime_settings` with a backend that cannot run here (named
    ``--backend triton`` without CUDA or the interpreter, or its kernels failing to import) as
    bad input (ValueError naming the flag: exit 2), never a quiet fallback."""
    try:
        return runtime_settings(model, backend)
    except RuntimeError as exc:
        raise ValueError(f"--backend {backend}: {exc}") from exc


def engine_meta(scorer: ICQSScorer, backend: str) -> dict:
    """The engine's plan for the meta file (:meth:`ModelPlan.as_meta`), with the path the
    scorer actually takes (cascade off by its settings runs the KV copies)."""
    plan = scorer.plan.as_meta(backend)
    if plan["path"] == "cascade" and not scorer.cascade:
        plan.update(path="kv-copy", fastest=False, why="cascade attention switched off "
                    "(cascade=False)", message=plan["message"].replace(
                        "cascade attention", "per-row KV copies (cascade switched off)"))
    return plan


@dataclass(frozen=True)
class DemoSets:
    """What :meth:`ScoreStrategy.prepare` reads and builds before a model loads: the
    demonstration pools (``(x, y)`` pairs), their demonstration sets (``[M+1][L]``, the
    scorer's ``sets``) and how they were stratified, as the run says it."""

    good: list[tuple[str, str]]
    bad: list[tuple[str, str]]
    sets: Any
    stratification: str


def output_summary(out: Path, *, label: bool = False) -> str:
    """One line on a whole results file (after a resumed run): its records, the bad records
    skipped in it and, for ``score`` output, the mean score (per label with ``label``)."""
    n = skipped = 0
    total = 0.0
    scored = 0
    by_label: dict[str, list[float]] = {}
    for _, _, row in read_rows(out, optional=("score", "label", "error", "n_tokens")):
        if "error" in row and "score" not in row and "n_tokens" not in row:
            skipped += 1
            continue
        n += 1
        score = row.get("score")
        if isinstance(score, (int, float)):
            scored += 1
            total += score
            if label:
                key = row.get("label")
                key = key if isinstance(key, str) else json.dumps(key)
                s = by_label.setdefault(key, [0, 0.0])
                s[0] += 1
                s[1] += score
    line = f"icqs-fast: the whole output {out} holds {n} records"
    if scored:
        line += f", mean score {total / scored:.4f}"
    if skipped:
        line += f", {skipped} bad records skipped"
    if by_label:
        line += "\n  mean score by label: " + ", ".join(
            f"{k}: {v[1] / v[0]:.4f} (n={v[0]})" for k, v in sorted(by_label.items()))
    return line


class ScoreStrategy:
    """``score``'s part of the job runner (:mod:`icqs_fast.jobs.runner`): an ICQSScorer over
    the records, one :func:`icqs_fast.io.schema.icqs_row` line each, a :class:`Summary` with
    label means."""

    desc = "score"
    done_prefix = "icqs-fast: "
    done_what = "scored"
    align = 1
    read_labels = True

    def __init__(self, config: ScoreJobConfig) -> None:
        self.config = config
        self.scorer: Any = None
        self.demos: DemoSets | None = None  # prepare's (a Ray actor gets the driver's)
        self.check: Any = None  # the SelfCheck in force (use_self_check)

    @property
    def settings(self) -> ScoringSettings:
        """The run's one ScoringSettings: built once by the command, used unchanged."""
        return self.config.scoring

    def prepare(self, log: Callable[..., None]) -> DemoSets:
        """What needs no model: read the demonstration files and build the demonstration
        sets (pool sizes, strata: errors before the model loads; the scorer takes these sets),
        and say which stratification was used; kept as :attr:`demos`."""
        from icqs_fast.engine.prompts import TooFewExamples, build_demo_sets

        c = self.config
        if c.good_bad_pairs is not None:
            good, bad = read_pool_pairs(c.good_bad_pairs, c.pair_fields(demos=True),
                                        encoding=c.encoding)
        else:
            ex_kw = dict(x_field=c.demo_x_field, y_field=c.demo_y_field, encoding=c.encoding)
            good = read_examples(c.good, **ex_kw)
            bad = read_examples(c.bad, **ex_kw)
        try:
            sets = build_demo_sets(good, bad, **self.settings.demo_set_options())
        except TooFewExamples as exc:  # said with the flags the user gave them by
            raise ValueError(exc.say(self.flag_of)) from None
        strata = sets[0][0].strata
        chosen = self.settings.stratify
        if strata is None:
            how = "unstratified"
        else:
            names = sorted(set(strata))
            by = "the answer" if chosen in ("auto", "y") else "a field of the demonstrations"
            how = (f"stratified by {by}"
                   f" ({len(names)} strata: {', '.join(map(str, names[:8]))}"
                   f"{', ...' if len(names) > 8 else ''})")
        # The --stratify-field value this setting comes from (a field name is resolved into
        # its values by the command).
        spec = chosen if chosen in ("auto", "y") else "none" if chosen is None else "FIELD"
        self.demos = DemoSets(good, bad, sets, f"{how} (--stratify-field {spec})")
        log(f"icqs-fast: demonstration sets {self.demos.stratification}")
        return self.demos

    def flag_of(self, name: str, value: Any) -> str:
        """The scoring option ``name`` set to ``value`` as a command line gives it
        (``--demos-per-set 8``, ``--replacement``), from its declaration."""
        flag = declaration(self.settings, name).flag or name
        return flag if value is True else f"{flag} {value}"

    def load(self, policy: Any, meta: dict, log: Callable[..., None]) -> None:
        """The model and the scorer (on the sets of :meth:`prepare`); the runtime settings
        (dtype, device, backend) added to ``meta``."""
        from icqs_fast.engine.memory_plan import model_free_bytes, scorer_memory_plan
        from icqs_fast.engine.scorer import ICQSScorer

        c = self.config
        demos = self.demos if self.demos is not None else self.prepare(log)
        good, bad = demos.good, demos.bad
        t_load = time.perf_counter()
        model, tok = c.load_model(resumed_dtype(policy, c.dtype))
        t_load = time.perf_counter() - t_load
        meta.update(checked_runtime(model, self.settings.backend))  # checked by the runner
        self.scorer = ICQSScorer(model, tok, good, bad, self.settings, sets=demos.sets)
        meta["engine"] = engine_meta(self.scorer, meta["backend"])
        # Before the first forward: a bank that cannot fit is refused with its numbers, and
        # forwards too large for what is left are split (a lower token budget).
        mem = scorer_memory_plan(self.scorer, model_free_bytes(model))  # a split model: all GPUs
        self.scorer.token_budget = mem.token_budget
        meta["memory_plan"] = mem.as_dict()
        log(f"icqs-fast: {mem.line()}")
        e = meta["engine"]
        log(f"icqs-fast: engine: {e['message']}; backend {e['backend']}"
            + ("" if e["fastest"] else " (not the fastest path)"))
        s = self.settings
        log(f"icqs-fast: model loaded in {t_load:.1f} s; {len(good)} good / {len(bad)} bad "
            f"demonstrations, {s.num_ratios} ratios x {s.sets_per_ratio} sets of "
            f"{s.demos_per_set}")

    def self_check(self, policy: Any, log: Callable[..., None],
                   run: Callable[[], dict] | None = None) -> dict:
        """The run's self-check from the pools (:mod:`icqs_fast.engine.selfcheck`), as a dict
        for the metadata: the one a resumed output's metadata holds; else, when it needs no
        scoring (off, or pools too small), computed at once; else by ``run`` when given (the
        ``--ray`` driver: a task on a worker) or with this strategy's scorer (:meth:`load`).
        Its map then gives each result ``p_good_calibrated`` and ``verdict``. Its size follows
        the job (:meth:`job_records`), and its held-out scores are read from / stored in the
        self-check cache (:mod:`icqs_fast.engine.selfcheck_cache`)."""
        from icqs_fast.engine.selfcheck import (
            DEFAULT_MAX_HELDOUT,
            SelfCheck,
            run_self_check,
            sized_max_heldout,
        )
        from icqs_fast.engine.selfcheck import too_small_without_scoring as too_small
        from icqs_fast.io.cache import JsonCache
        from icqs_fast.progress import track

        c = self.config
        demos = self.demos if self.demos is not None else self.prepare(log)
        old = resumed_meta(policy)
        if old is not None:
            if "self_check" not in old:
                check = SelfCheck.off("not run (resuming an output written without one)")
            else:
                check = SelfCheck.from_dict(old["self_check"])
                log(f"icqs-fast: self-check of the resumed output reused: {check.message}")
        else:
            kw = c.self_check.kwargs()
            if c.pairs is not None or c.good_bad_pairs is not None:
                # Pairs are judged (or the pools are pairs): held out by instruction, and
                # said over pairs too.
                kw.update(pairwise=True, tie_margin=c.pair_options.tie_margin)
            # The default size follows the job; a --self-check-max of one's own is as asked.
            kw["job_records"] = (self.job_records(policy, kw["max_heldout"])
                                 if kw["max_heldout"] == DEFAULT_MAX_HELDOUT else None)
            n = sized_max_heldout(kw["max_heldout"], kw["job_records"])
            if n == 0 or too_small(len(demos.good), len(demos.bad), n):
                check = run_self_check(None, demos.good, demos.bad, **kw)  # scores nothing
            elif run is not None:
                check = SelfCheck.from_dict(run())
            else:
                def bar(it: Iterable, total: int) -> Iterable:
                    return track(it, total=total, desc="self-check", unit="item",
                                 quiet=c.quiet)

                check = run_self_check(self.scorer, demos.good, demos.bad, progress=bar,
                                       cache=JsonCache("selfcheck"), **kw)
            for line in check.lines():
                log(f"icqs-fast: {line}")
        self.use_self_check(check)
        return check.to_dict()

    def job_records(self, policy: Any, limit: int) -> int | None:
        """The records this job scores when at most ``limit`` (the self-check's size, which
        follows the job: :func:`icqs_fast.engine.selfcheck.sized_max_heldout`), else None; from
        the shard or the Parquet metadata, or by reading at most ``limit + 1`` records. None
        without a job (``check``), for standard input, or where the input cannot be read (a
        Ray worker)."""
        import itertools

        from icqs_fast.io.readers import RecordFields, read_records
        from icqs_fast.io.runs import input_range

        c = self.config
        if policy is None or c.input == "-":
            return None
        try:
            _, _, total = input_range(c.input, c.format, c.encoding, c.shard, policy)
            if total < 0:
                total = sum(1 for _ in itertools.islice(read_records(
                    c.input, RecordFields(c.x_field, c.y_field), format=c.format,
                    encoding=c.encoding, skip=policy.start, on_error="yield"), limit + 1))
        except (OSError, InputError):
            return None
        return total if total <= limit else None

    def use_self_check(self, check: Any) -> None:
        """Give the results the map of ``check`` (a fitted SelfCheck or its dict) when it has
        one; its verdict goes into the summary."""
        from icqs_fast.engine.selfcheck import SelfCheck

        self.check = check if isinstance(check, SelfCheck) else SelfCheck.from_dict(check)
        if self.scorer is not None:
            self.scorer.self_check = self.check if self.check.ok else None

    def results(self, records: Iterable[Record | RecordError], *, write_from: int,
                on_error: Callable[[RecordError], None] | None
                ) -> Iterator[tuple[Record, Any]]:
        c = self.config
        return score_records(self.scorer, records, path=c.input_name, x_field=c.x_field,
                             y_field=c.y_field, on_error=on_error)

    def line(self, rec: Record, res: Any) -> dict:
        return icqs_row(rec, res, with_label=self.config.label_field is not None)

    def table_schema(self) -> Any:
        return arrow_schema("icqs")

    def summary(self) -> Summary:
        check = self.check
        return Summary(with_label=self.config.label_field is not None,
                       notes=check.lines() if check is not None and check.ok else ())

    def output_summary(self, out: Path) -> str:
        """One line on the whole output after a resumed run (:func:`output_summary`: the
        mean score, per label with ``--label-field``)."""
        return output_summary(out, label=self.config.label_field is not None
                              and self.read_labels)
