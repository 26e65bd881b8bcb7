"""``icqs-fast score --pairs``: which of two outputs to one instruction is better, per pair of
a file, streamed to JSONL or Parquet.

    icqs-fast score --pairs pairs.jsonl -o judged.jsonl --good good.jsonl --bad bad.jsonl

A pair is one record with ``x``, ``y_a`` and ``y_b`` (``--x-field``, ``--y-a-field``,
``--y-b-field``), or two consecutive records sharing ``--pair-field`` (a then b;
:func:`icqs_fast.io.readers.read_pairs`). :class:`PairStrategy` is ``score``'s strategy with
pairs for records: both outputs of every pair go into the one scoring stream
(:func:`icqs_fast.engine.pairs.score_pairs`), each pair gives one
:func:`icqs_fast.io.schema.pair_row` line, and the summary (:class:`PairSummary`) gives the
pairwise accuracy with its interval when the pairs carry the better output (``--label-field``),
beside the length judge's. The whole input is read once before the model loads, so a bad pair
(a missing output, a group of another size than 2) stops the run before anything is written.
``--resume`` continues after the last pair written (by its index, checking its id) and
``--shard i/n`` judges the pairs whose first record lies in the i-th record range
(:meth:`PairStrategy.read_input`), and a ``--ray`` block those whose first record lies in it
(:attr:`PairStrategy.pair_fields`); the driver merges the blocks' :meth:`PairSummary.state`.

``--good-bad-pairs FILE`` (also without ``--pairs``): the pools as pairs, the better output
into the good pool, the other into the bad pool
(:func:`icqs_fast.io.readers.read_pool_pairs`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from icqs_fast.engine.pairs import length_preferences, pairwise_accuracy, score_pairs
from icqs_fast.io.readers import PairFields, read_pairs
from icqs_fast.io.records import InputError, PairRecord, Record, RecordError
from icqs_fast.io.runs import OutputPolicy, input_range
from icqs_fast.io.schema import arrow_schema, pair_row
from icqs_fast.jobs.config import ScoreJobConfig
from icqs_fast.jobs.score import ScoreStrategy, check_record, ordered_results

__all__ = ["PairStrategy", "PairSummary"]


class PairSummary:
    """Running count of the pairs judged and of their ``preferred``; with labels, the
    pairwise accuracy with its 95 % interval beside the length judge's (whichever of the
    shorter or the longer output the pools favour)."""

    def __init__(self, with_label: bool = False, notes: Iterable[str] = (),
                 shorter: bool = True) -> None:
        self.with_label = with_label
        self.notes = list(notes)
        self.shorter = shorter
        self.n = 0
        self.skipped = 0
        self.preferred: list[str] = []
        self.by_length: list[str] = []
        self.better: list[str] = []
        self.t0 = time.perf_counter()

    def add(self, rec: PairRecord, res: Any) -> None:
        self.n += 1
        self.preferred.append(res.preferred)
        self.by_length += length_preferences([(rec.x, rec.y_a, rec.y_b)], shorter=self.shorter)
        if self.with_label:
            self.better.append(rec.label)

    def state(self) -> dict:
        """What :meth:`merge` adds to another summary (a ``--ray`` block's, to the driver's)."""
        return {k: getattr(self, k) for k in ("n", "skipped", "preferred", "by_length", "better")}

    def merge(self, state: dict) -> None:
        """Add another summary's :meth:`state` (merged in input order: the one run's figures)."""
        for k, v in state.items():
            setattr(self, k, getattr(self, k) + v)

    def accuracies(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """``(ICQS, the length judge)``: each ``(accuracy, lo, hi)`` over the labelled pairs
        (:func:`icqs_fast.engine.pairs.pairwise_accuracy`)."""
        return (pairwise_accuracy(self.preferred, self.better),
                pairwise_accuracy(self.by_length, self.better))

    def text(self, prefix: str = "") -> str:
        dt = time.perf_counter() - self.t0
        rate = self.n / dt if dt > 0 else 0.0
        counts = ", ".join(f"{k} {self.preferred.count(k)}" for k in ("a", "b", "tie"))
        parts = [f"{prefix}judged {self.n} pairs in {dt:.1f} s ({rate:.2f} pairs/s)",
                 f"preferred: {counts}"]
        if self.skipped:
            parts.append(f"{self.skipped} bad pairs skipped")
        lines = [", ".join(parts)]
        if self.with_label and self.n:
            (acc, lo, hi), (lacc, llo, lhi) = self.accuracies()
            which = "shorter" if self.shorter else "longer"
            lines.append(f"pairwise accuracy {acc:.3f} [{lo:.3f}, {hi:.3f}] (95 % interval, "
                         f"{self.n} pairs); the length judge (the {which} output, as the "
                         f"pools favour) {lacc:.3f} [{llo:.3f}, {lhi:.3f}]")
            if llo > hi:
                lines.append(f"the length judge beats ICQS on these pairs ({lacc:.3f} against "
                             f"{acc:.3f}): try length-balanced pools, `features`, or a larger "
                             "--model")
        return "\n  ".join([*lines, *self.notes])


class PairStrategy(ScoreStrategy):
    """``score --pairs``'s part of the job runner: :class:`ScoreStrategy` (pools, model,
    self-check) with pairs for records (see the module docstring)."""

    desc = "score pairs"
    done_what = "judged"
    unit = "pair"  # of the progress bar

    @property
    def records_per_result(self) -> int:
        """Input records per output line (the progress bar's total is the file's records)."""
        return 1 if self.config.pair_options.pair_field is None else 2

    def read_input(self, *, skip: int = 0, stop: int | None = None,
                   **kw: Any) -> Iterator[PairRecord | RecordError]:
        """The input's pairs whose index (the record of a, or of the bad record) lies in
        ``[skip, stop)`` - what ``--resume`` (after the last pair written) and ``--shard``
        (a pair goes to the shard holding its first record) read; ``kw``:
        :func:`~icqs_fast.io.readers.read_pairs`' on_error, allow_empty."""
        c = self.config
        return read_pairs(c.input, c.pair_fields(), format=c.format, encoding=c.encoding,
                          skip=skip, stop=stop, **kw)

    @property
    def pair_fields(self) -> PairFields:
        """The input's PairFields (a ``--ray`` block's :class:`~.ray_actors.BlockSpec`)."""
        return self.config.pair_fields()

    def peek_input(self, config: ScoreJobConfig) -> None:
        """Every pair is read before the model loads (reading costs nothing beside scoring):
        a whole-file error, or with ``--on-error stop`` the first bad pair (of this shard's
        range with ``--shard``; after the output's last pair with ``--resume``, which the run
        checks), stops the run before anything is written. Standard input cannot be read
        twice: only its run checks it."""
        if config.input == "-":
            return
        lo, hi, _ = input_range(config.input, config.format, config.encoding, config.shard,
                                OutputPolicy(config.output))  # the shard's records (or all)
        for p in self.read_input(on_error="yield", allow_empty=False):
            if (isinstance(p, RecordError) and config.on_error == "stop" and not config.resume
                    and p.index >= lo and (hi is None or p.index < hi)):
                raise p

    def job_records(self, policy: Any, limit: int) -> int | None:
        """The responses this job scores (two per pair) when at most ``limit``, else None."""
        if policy is None or self.config.input == "-":
            return None
        try:
            n = 2 * sum(1 for _ in itertools.islice(self.read_input(on_error="yield"),
                                                    limit // 2 + 1))
        except (OSError, InputError):
            return None
        return n if n <= limit else None

    def check_pair(self, p: PairRecord) -> RecordError | None:
        """What the scorer would reject in either output of ``p`` (see
        :func:`~icqs_fast.jobs.score.check_record`), naming that output's field."""
        c = self.config
        opts = c.pair_options
        grouped = opts.pair_field is not None
        for y, field in ((p.y_a, opts.y_a_field), (p.y_b, opts.y_b_field)):
            bad = check_record(self.scorer, Record(p.index, p.line, p.x, y), path=c.input_name,
                               x_field=c.x_field, y_field=c.y_field if grouped else field)
            if bad is not None:
                return bad
        return None

    def results(self, records: Iterable[Any], *, write_from: int,
                on_error: Callable[[RecordError], None] | None
                ) -> Iterator[tuple[PairRecord, Any]]:
        tie = self.config.pair_options.tie_margin
        return ordered_results(records, self.check_pair, lambda p: (p.x, p.y_a, p.y_b),
                               lambda items: score_pairs(self.scorer, items, tie_margin=tie),
                               on_error)

    def line(self, rec: PairRecord, res: Any) -> dict:
        return pair_row(res, rec, with_label=self.config.label_field is not None)

    def table_schema(self) -> Any:
        return arrow_schema("pairs")

    def summary(self) -> PairSummary:
        check = self.check
        good, bad = (self.demos.good, self.demos.bad) if self.demos is not None else ((), ())
        mean = [sum(len(y) for _, y in pool) / max(len(pool), 1) for pool in (good, bad)]
        return PairSummary(with_label=self.config.label_field is not None,
                           notes=check.lines() if check is not None and check.ok else (),
                           shorter=mean[0] <= mean[1])
