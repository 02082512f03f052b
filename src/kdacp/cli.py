"""The ``kdacp`` command's entry: parses the command line without torch (:mod:`kdacp.options`), so that
``--help`` and ``--version`` answer at once, then runs the command (:mod:`kdacp.commands`)."""
from __future__ import annotations

import sys
import time

from .options import EXIT_STATUS, build_parser, log_level, parse_args

__all__ = ["EXIT_STATUS", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); its exit status (:data:`EXIT_STATUS`): 0
    success, 1 a failed check or run, 2 a usage error (argparse's, or a one-line refusal before any worker
    starts), 130 a Ctrl-C (128 + N a run stopped by signal N)."""
    entered_at = time.time()
    args = parse_args(argv)
    args.entered_at = entered_at
    try:
        from .commands import run  # torch and the rest: seconds
        from .workers import configure_logging
        configure_logging(log_level(args))
        return run(args)
    except KeyboardInterrupt:  # before or after a launch (during one, the launcher stops its workers)
        print(f"kdacp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
