"""The ``kdacp`` command's entry point, outside the ``kdacp`` package so that it runs before the package's
imports (torch, Triton: seconds): a Ctrl-C while they load ends the command with one line, not a traceback.
``python -m kdacp_command`` is the same command."""
import sys


def main() -> int:
    """Import :mod:`kdacp.cli` and run its ``main``; exit status 130 after a Ctrl-C during the import."""
    try:
        from kdacp.cli import main as run
    except KeyboardInterrupt:
        print("kdacp: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
