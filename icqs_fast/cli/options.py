"""Option groups several commands share, written once so their names, choices and help agree."""

from __future__ import annotations

import argparse

from icqs_fast.engine.settings import CALIBRATIONS, SCORE_KINDS, TIE_EPSILON


def add_calibration_arguments(p: argparse.ArgumentParser) -> None:
    """``--calibrate`` and ``--score`` (issue 17), as ``score`` and ``eval`` take them."""
    p.add_argument("--calibrate", default="none", choices=list(CALIBRATIONS),
                   help="calibrate the ICQS log-likelihoods: content_free = minus log P(y | "
                        "demos, content-free input) (Zhao et al. 2021), pmi = minus log P(y | "
                        "demos, domain premise) (Holtzman et al. 2021); default none")
    p.add_argument("--score", default="argmax", choices=list(SCORE_KINDS),
                   help="ICQS score: the ratio of the most likely context (argmax, default), "
                        "the mean ratio of the contexts within --tie-epsilon nats of it (tied: "
                        "a rounding change cannot flip it), or the posterior mean (mean)")
    p.add_argument("--tie-epsilon", type=float, default=TIE_EPSILON, metavar="NATS",
                   help="--score tied: contexts within this many nats of the most likely one "
                        f"count as tied (default {TIE_EPSILON}, from the measured fp32/bf16 "
                        "noise); also the noise level of the near_ties diagnostic")
