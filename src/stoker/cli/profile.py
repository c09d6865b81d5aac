"""``stoker profile -- python train.py ...``: run a training script unchanged and report whether it is data-bound.

At exit prints the report of every Loader and flow the script made (the share of
its time the loop waited for data, the verdict, the stage that caused most
waiting and a suggestion) and writes ``report.txt``, ``trace.json`` (open it in
Perfetto) and, when matplotlib is installed (``pip install matplotlib``), ``steps.png``
(per-step wait against step time) to ``--out``. The script's exit status is the command's.

The command is ``python script.py [args]`` or ``python -m module [args]`` (``python``
may be left out): the script, a ``.py`` file or other Python source, runs inside
stoker's own Python, so interpreter options such as ``-u``, ``-X`` or ``-W`` are
refused (give them to that Python: ``python -u -m stoker profile -- python
train.py``), and so is ``-c``. A script that does not exist, a file that is not
Python (``/usr/bin/env``, a shell script) and an ``--out`` that is not a folder are
refused before anything runs, with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``profile`` sub-command to a ``stoker`` argument parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "profile",
        help="run a training script and say whether it waits for data, and on which stage",
        description=__doc__.split("\n\n")[1],
        epilog=__doc__.split("\n\n")[2],
        usage="stoker profile [--out DIR] -- python train.py [args ...] | python -m module [args ...]",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("stoker-profile"), help="folder for report.txt, trace.json and steps.png (needs matplotlib)"
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the command line of the script: python train.py [args] or python -m module [args]; no python options but -m",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the script given after ``--``; its exit status, or 2 when the command or ``--out`` is refused before it runs."""
    from stoker.observe import _profile

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        return _profile.run(command, args.out)
    except ValueError as exc:
        print(f"stoker profile: {exc}", file=sys.stderr)
        return 2
