"""`python -m grader labs` (regenerate labs/ from solutions/) and
`python -m grader batch SUBMISSIONS_DIR --lab NN_name [--jobs N]` (instructor batch grading)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("labs", help="regenerate labs/ from solutions/ (nbgrader generate_assignment)")
    batch = sub.add_parser("batch", help="grade a folder of submissions, each in its own process")
    from grader.batch.grade import add_arguments

    add_arguments(batch)
    args = parser.parse_args(argv)
    if args.command == "labs":
        from grader.release import regenerate

        regenerate()
        return 0
    from grader.batch.grade import run_batch_cli

    return run_batch_cli(args)


if __name__ == "__main__":
    sys.exit(main())
