"""Option groups several commands share, written once so their names, choices and help agree."""

from __future__ import annotations

import argparse

from icqs_fast.engine.settings import CALIBRATIONS, DEFAULT_SCORE, SCORE_KINDS, TIE_EPSILON


def add_calibration_arguments(p: argparse.ArgumentParser, default_score: str = DEFAULT_SCORE
                              ) -> None:
    """``--calibrate``, ``--score`` and ``--tie-epsilon`` (issues 17, 29), as ``score``, ``eval``,
    ``demo`` and ``serve`` take them (``eval`` keeps the paper's argmax as its default)."""
    p.add_argument("--calibrate", default="none", choices=list(CALIBRATIONS),
                   help="calibrate the ICQS log-likelihoods: content_free = minus log P(y | "
                        "demos, content-free input) (Zhao et al. 2021), pmi = minus log P(y | "
                        "demos, domain premise) (Holtzman et al. 2021); default none")
    p.add_argument("--score", default=default_score, choices=list(SCORE_KINDS),
                   help="ICQS score: the posterior mean of the ratio (mean: stable across "
                        "dtypes and backends), the ratio of the most likely context (argmax, "
                        "the paper's), or the mean ratio of the contexts within --tie-epsilon "
                        f"nats of it (tied); default {default_score}")
    p.add_argument("--tie-epsilon", type=float, default=TIE_EPSILON, metavar="NATS",
                   help="--score tied: contexts within this many nats of the most likely one "
                        f"count as tied (default {TIE_EPSILON}, from the measured fp32/bf16 "
                        "noise); also the noise level of the near_ties diagnostic")
