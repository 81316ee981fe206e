"""The `memfit` command line (also `python -m memfit`)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit", description="Train bigger models in less GPU memory.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    d = sub.add_parser("doctor", help="show what memfit was built with and what it sees at run time")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from memfit import doctor

        return doctor.main(as_json=args.json)
    return 2  # argparse rejects unknown commands before this


if __name__ == "__main__":
    sys.exit(main())
