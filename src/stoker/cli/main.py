"""The ``stoker`` command: one argparse sub-command per module of :mod:`stoker.cli`.

Each sub-command module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` (``args -> exit code``) with ``set_defaults``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stoker import __version__
from stoker.cli import bench, convert, inspect, profile, warmup


def build_parser() -> argparse.ArgumentParser:
    """The ``stoker`` argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(prog="stoker", description="Write, inspect, benchmark and profile stoker datasets.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in (inspect, convert, bench, profile, warmup):
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stoker`` command line.

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code: 0 on success, 1 on a reported error, 2 on a usage error.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
