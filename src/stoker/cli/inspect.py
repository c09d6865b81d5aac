"""``stoker inspect FILE``: what a stoker file holds, and optionally whether it is intact.

Prints the path, format version, sample count, file size and one row per
field (name, type, args, storage, bytes). ``--verify`` also checks every
checksum. Errors print one line to stderr and exit with code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def human_size(n: int) -> str:
    """``1536`` -> ``'1,536 bytes (1.5 KiB)'``."""
    exact = f"{n:,} bytes"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return exact if unit == 0 else f"{exact} ({value:.1f} {_UNITS[unit]})"


def _format_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in args.items()) or "-"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def describe(path: Path, verify: bool = False) -> str:
    """The text that ``stoker inspect`` prints for ``path``.

    Raises:
        DatasetFormatError: the file cannot be read, is not a valid stoker
            file, or (with ``verify``) a checksum does not match.
    """
    from stoker.format.reader import Reader

    with Reader(path) as reader:
        sizes = reader.field_sizes()
        rows = [
            [name, field.TYPE_NAME, _format_args(field.to_args()), field.storage, f"{sizes[name]:,}"]
            for name, field in reader.fields.items()
        ]
        lines = [
            f"path:           {reader.path.resolve()}",
            f"format version: {reader.version}",
            f"samples:        {len(reader):,}",
            f"file size:      {human_size(reader.file_size)}",
            "",
            _table(["field", "type", "args", "storage", "bytes"], rows, right={4}),
        ]
        if verify:
            reader.verify()
            lines += ["", "all checksums OK"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the description of ``args.file``; 1 with a one-line message on error."""
    from stoker.errors import DatasetFormatError

    try:
        text = describe(Path(args.file), verify=args.verify)
    except (DatasetFormatError, OSError) as exc:
        print(f"stoker inspect: error: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``inspect`` sub-command to a ``stoker`` argument parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "inspect", help="describe a stoker file (fields, sizes) and optionally verify it", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("file", help="the stoker file to describe")
    parser.add_argument("--verify", action="store_true", help="also check every checksum (reads the whole file)")
    parser.set_defaults(func=run)
