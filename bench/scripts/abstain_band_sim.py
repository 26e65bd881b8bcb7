"""The abstain band on simulated self-checks: does the accuracy outside the band on new scores
reach the target, and fall inside the band's stated interval? (docs/scoring_files.md, *Verdict
and abstain band*.)

    python -m bench.scripts.abstain_band_sim [--seeds 20] [--target 0.85]

Each seed: 128 good scores ~ N(1, 1) and 128 bad ~ N(0, 1) as the held-out items (AUC about
0.76), the band from icqs_fast.engine.abstain.abstain_band with the self-check's own options,
then 200,000 fresh scores of each class judged by it.
"""

import argparse

import numpy as np

from icqs_fast.engine.abstain import abstain_band, band_verdicts
from icqs_fast.engine.selfcheck import CV_FOLDS, LEVEL, N_BOOT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--target", type=float, default=0.85)
    a = ap.parse_args()
    inside, accs = 0, []
    for seed in range(a.seeds):
        rng = np.random.default_rng(seed)
        n, big = 128, 200_000
        s = np.concatenate([rng.normal(1, 1, n), rng.normal(0, 1, n)])
        y = np.r_[np.ones(n), np.zeros(n)].astype(int)
        b = abstain_band(s, y, a.target, folds=CV_FOLDS, seed=seed, n_boot=N_BOOT, level=LEVEL)
        st = np.concatenate([rng.normal(1, 1, big), rng.normal(0, 1, big)])
        yt = np.r_[np.ones(big), np.zeros(big)]
        v = band_verdicts(st, b.lo, b.hi)
        cov = v != "abstain"
        acc = (((v == "good") & (yt == 1)) | ((v == "bad") & (yt == 0))).sum() / cov.sum()
        ok = b.accuracy_lo <= acc <= b.accuracy_hi
        inside += ok
        accs.append(acc)
        print(f"seed {seed}: aim {b.aim:.2f}, coverage {b.coverage:.2f} [{b.coverage_lo:.2f}, "
              f"{b.coverage_hi:.2f}] (new {cov.mean():.2f}); accuracy {b.accuracy:.3f} "
              f"[{b.accuracy_lo:.3f}, {b.accuracy_hi:.3f}] (new {acc:.3f}) "
              f"{'inside' if ok else 'OUTSIDE'}")
    print(f"mean accuracy on new scores {np.mean(accs):.3f} for target {a.target}; inside the "
          f"interval {inside} of {a.seeds}")


if __name__ == "__main__":
    main()
