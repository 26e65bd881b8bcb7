"""``icqs-fast report``: one self-contained HTML page of a scoring run, and its drift against a
baseline run (:mod:`icqs_fast.report.run_report`, :mod:`icqs_fast.report.drift`).

    icqs-fast report OUTPUT [-o report.html] [--input FILE] [--baseline OTHER_OUTPUT]
                     [--fail-on-drift] [--json]

Exit codes: 0; 1 with --fail-on-drift when the runs differ beyond noise; 2 for bad input (a
missing or unreadable output, named with its file and line).
"""

from __future__ import annotations

import argparse
import json
import sys

from icqs_fast.options import add_json_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("output", help="a run's output: a JSONL or Parquet results file, or a "
                   "--ray output folder (its meta file is read next to it)")
    p.add_argument("-o", "--out", default="report.html", metavar="HTML",
                   help="the page to write (default: report.html)")
    p.add_argument("--input", default=None, metavar="FILE",
                   help="the scored input file: the page then shows the texts of the records "
                   "it lists (read with the run's fields and encoding)")
    p.add_argument("--baseline", default=None, metavar="OTHER_OUTPUT",
                   help="another run's output to compare with: score and calibrated-"
                   "probability distributions (KS, PSI), self-checks, and the records in both")
    p.add_argument("--fail-on-drift", action="store_true",
                   help="exit 1 when the runs differ beyond noise (needs --baseline)")
    add_json_argument(p, "print the drift comparison (or the page's figures) as JSON")


def run(args: argparse.Namespace) -> int:
    from icqs_fast.report.run_report import write_report

    if args.fail_on_drift and args.baseline is None:
        raise ValueError("--fail-on-drift needs --baseline")
    res = write_report(args.output, args.out, baseline=args.baseline, input=args.input)
    if args.json:
        doc = {"page": str(res.path), "bytes": res.bytes, "records": res.n,
               "seconds": round(res.seconds, 3),
               "drift": res.drift.to_dict() if res.drift is not None else None}
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(f"icqs-fast: wrote {res.path} ({res.bytes / 1024:.0f} KiB, {res.n:,} records, "
              f"{res.seconds:.1f} s)", file=sys.stderr)
        if res.drift is not None:
            print(res.drift.verdict)
            for item in res.drift.items:
                print(f"  [{'moved' if item.moved else 'ok'}] {item.text}")
    if args.fail_on_drift and res.drift is not None and res.drift.moved:
        return 1
    return 0
