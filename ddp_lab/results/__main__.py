"""python -m ddp_lab.results check [--root DIR] [FINDING ...]
python -m ddp_lab.results unquoted [--root DIR] [FINDING ...]"""

from __future__ import annotations

import argparse
import sys

from ddp_lab.results import unquoted
from ddp_lab.results.check import check, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.results",
                                     description="check: recompute every quoted figure from its "
                                     "raw files; unquoted: list the numbers pages print that no "
                                     "figure quotes (places to look; exits 0)")
    parser.add_argument("command", choices=["check", "unquoted"])
    parser.add_argument("findings", nargs="*", help="finding folders to check (default: all, "
                        "and the headline places)")
    parser.add_argument("--root", default=".", help="the repository root (default: .)")
    args = parser.parse_intermixed_args(argv)
    if args.command == "unquoted":
        print(unquoted.report(args.root, args.findings or None))
        return 0
    text, ok = report(*check(args.root, args.findings or None))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
