"""The self-check's reliability diagram (matplotlib, Agg backend, one PNG).

:func:`plot_reliability` draws, from a :class:`~icqs_fast.engine.selfcheck.SelfCheck` alone (so
also from one read back from a run's meta file): left, the fraction of good answers against the
mean calibrated probability in each equal-width bin of the held-out items' out-of-fold
probabilities (the diagonal is perfect calibration; the bars count items per bin); right, the
fitted map from the raw score to P(good) over the held-out scores' range, with the equal-error
threshold.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never a window, whatever the environment
    import matplotlib.pyplot as plt

    return plt


def plot_reliability(check: Any, path: str | os.PathLike, *, title: str = "") -> Path:
    """Write the reliability diagram of ``check`` (a ``SelfCheck`` with ``status == "ok"``) to
    the PNG ``path`` (folders created); ValueError without an estimate."""
    if not check.ok or check.calibration is None:
        raise ValueError(f"no reliability diagram: {check.message}")
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    bins = [b for b in check.reliability if b["count"]]
    mp = np.array([b["mean_p"] for b in bins])
    fp = np.array([b["frac_pos"] for b in bins])
    ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect")
    ax.plot(mp, fp, marker="o", label=f"held out, out of fold (ECE {check.ece:.3f})")
    ax2 = ax.twinx()
    ax2.bar([(b["lo"] + b["hi"]) / 2 for b in check.reliability],
            [b["count"] for b in check.reliability],
            width=1.0 / max(1, len(check.reliability)), alpha=0.15, color="C0")
    ax2.set_ylabel("items per bin")
    ax.set_zorder(ax2.get_zorder() + 1)  # the curve over the count bars
    ax.patch.set_visible(False)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("calibrated P(good)")
    ax.set_ylabel("fraction good")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("reliability")
    lo, hi = check.score_range if check.score_range else (0.0, 1.0)
    pad = (hi - lo) * 0.1 or 0.01
    s = np.linspace(lo - pad, hi + pad, 200)
    bx.plot(s, check.apply(s), label=f"{check.calibration.method} map")
    if math.isfinite(check.threshold):
        bx.axvline(check.threshold, color="C3", linestyle=":",
                   label=f"equal-error threshold {check.threshold:.4f}")
    bx.set_ylim(0, 1)
    bx.set_xlabel("score")
    bx.set_ylabel("P(good)")
    bx.legend(loc="upper left", fontsize=8)
    bx.set_title(f"AUC {check.auc:.3f} [{check.auc_lo:.3f}, {check.auc_hi:.3f}], "
                 f"n = {check.n_good} + {check.n_bad}")
    if title:
        fig.suptitle(title)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
