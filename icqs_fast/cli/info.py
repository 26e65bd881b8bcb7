"""``icqs-fast info``: versions, device, available backends and the dtype ``--dtype auto`` picks.
"""

from __future__ import annotations

import argparse
import json

from icqs_fast.options import add_json_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "versions, device, available backends and the dtype --dtype auto picks"
    add_json_argument(p, "print JSON")


def run(args: argparse.Namespace) -> int:
    from icqs_fast.info import collect  # torch: only when run

    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if k == "backends":
            print("backends:")
            for name, b in v.items():
                mark = "yes" if b["available"] else "no "
                print(f"  {name:7s} {mark}  {b['reason']}")
        else:
            print(f"{k}: {v}")
    return 0
