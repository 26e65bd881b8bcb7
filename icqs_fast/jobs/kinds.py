"""The job kinds: what a kind adds to the job runner (:class:`JobStrategy`) and which kinds
there are (:data:`STRATEGIES`: ``score``, ``pairs``, ``features``), found by a config's
``kind`` (:func:`strategy_for`). Below :mod:`icqs_fast.jobs.runner`, which names no kind."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from icqs_fast.io.records import Record, RecordError
from icqs_fast.io.runs import OutputPolicy
from icqs_fast.jobs.config import JobConfig
from icqs_fast.registry import Registry

Log = Callable[..., None]


class JobSummary(Protocol):
    n: int
    skipped: int

    def add(self, rec: Record, res: Any) -> None: ...

    def text(self, prefix: str = "") -> str: ...


class JobStrategy(Protocol):
    """What a job kind adds to the runner (built from its config: ``Strategy(config)``).

    A kind whose records are not plain ones (``score --pairs``: jobs.pairs.PairStrategy) may
    also have ``peek_input(config)`` (in place of :func:`peek_input`), ``read_input(**kw)``
    (in place of :func:`~icqs_fast.io.readers.read_records`: :func:`input_records`),
    ``records_per_result`` and ``unit`` (the progress bar's); the runner looks them up.
    """

    desc: str  # progress bar label
    done_prefix: str  # the final summary line's prefix
    done_what: str  # what the run did to its responses, in a summary line ("scored")
    align: int  # shard boundaries and resume restarts are multiples of this (chunked jobs)
    read_labels: bool  # read the label field into the records (and summarise by label)

    def prepare(self, log: Log) -> None:
        """What needs no model (score: the demonstration sets), before the output is touched."""

    def load(self, policy: OutputPolicy | None, meta: dict, log: Log) -> None:
        """Load the model and build the engine; add what is known only now (dtype, device,
        backend, ...) to ``meta`` (the runner checks it against a resumed output)."""

    def self_check(self, policy: OutputPolicy | None, log: Log,
                   run: Callable[[], dict] | None = None) -> dict | None:
        """The run's self-check (a dict for the metadata; None for a kind without one): a
        resumed output's, else computed - by ``run`` when given (elsewhere), else here."""

    def use_self_check(self, check: dict) -> None:
        """Apply a self-check computed elsewhere (a ``--ray`` actor gets the driver's)."""

    def results(self, records: Iterable[Record | RecordError], *, write_from: int,
                on_error: Callable[[RecordError], None] | None
                ) -> Iterator[tuple[Record, Any]]:
        """``(record, result)`` in input order (records before ``write_from`` are computed
        only as context, not yielded); bad records go to ``on_error`` or are raised."""

    def line(self, rec: Record, res: Any) -> dict:
        """The output line of one result."""

    def table_schema(self) -> Any:
        """The ``pyarrow.Schema`` of a Parquet output (:func:`icqs_fast.io.schema.arrow_schema`)."""

    def summary(self) -> JobSummary: ...

    def output_summary(self, out: Path) -> str:
        """One line on the whole output ``out`` after a resumed run (what it holds)."""



# The strategy class of each job kind (``JobConfig.kind``), imported when a job of that kind
# runs (the strategies' modules build on this one).
STRATEGIES: Registry[Callable[[Any], JobStrategy]] = Registry("job kind")


@STRATEGIES.add("score")
def _score_strategy() -> Callable[[Any], JobStrategy]:
    from icqs_fast.jobs.score import ScoreStrategy
    return ScoreStrategy


@STRATEGIES.add("pairs")
def _pair_strategy() -> Callable[[Any], JobStrategy]:
    from icqs_fast.jobs.pairs import PairStrategy
    return PairStrategy


@STRATEGIES.add("features")
def _feature_strategy() -> Callable[[Any], JobStrategy]:
    from icqs_fast.jobs.features import FeatureStrategy
    return FeatureStrategy


def strategy_for(config: JobConfig) -> JobStrategy:
    """The strategy of ``config``'s job kind (:data:`STRATEGIES`)."""
    if config.kind not in STRATEGIES:
        raise TypeError(f"no job for {type(config).__name__} (kind {config.kind!r})")
    return STRATEGIES.get(config.kind)(config)


