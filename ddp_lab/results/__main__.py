"""python -m ddp_lab.results check [--root DIR] [FINDING ...]"""

from __future__ import annotations

import argparse
import sys

from ddp_lab.results.check import check, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.results",
                                     description="Recompute every quoted figure from its raw files.")
    parser.add_argument("command", choices=["check"])
    parser.add_argument("findings", nargs="*", help="finding folders to check (default: all, "
                        "and the headline places)")
    parser.add_argument("--root", default=".", help="the repository root (default: .)")
    args = parser.parse_intermixed_args(argv)
    text, ok = report(*check(args.root, args.findings or None))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
