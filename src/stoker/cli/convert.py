"""``stoker convert SOURCE ...``: write a stoker file from another dataset layout.

Wiring only; the work is in :mod:`stoker.convert.imagefolder`.

stoker convert imagefolder SRC DST reads a class-per-folder image tree
(torchvision's ImageFolder layout: SRC/<class>/<image>) and writes DST with
the fields image and label, plus the class names in DST.classes.json. Errors
print one line to stderr and exit with code 1."""

from __future__ import annotations

import argparse
import sys
from typing import Any

_WRITE_MODES = ("raw", "jpg", "smart", "proportion")  # RGBImageField's, repeated to keep numpy out of `stoker --help`


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}")
    return value


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (one per CPU) or an integer >= 0; got {text!r}")
    return value


def _quality(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..100; got {text!r}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1]; got {text!r}")
    return value


def summary_text(summary: Any) -> str:
    """The lines that ``stoker convert imagefolder`` prints for a :class:`~stoker.convert.imagefolder.ConversionSummary`."""
    from stoker.cli.inspect import human_size

    names = ", ".join(summary.classes[:5]) + (f", ... ({len(summary.classes) - 5} more)" if len(summary.classes) > 5 else "")
    lines = [
        f"wrote:    {summary.path.resolve()}",
        f"images:   {summary.images:,}",
        f"classes:  {len(summary.classes):,} ({names}); names in {summary.classes_path.resolve()}",
        f"bytes:    {human_size(summary.bytes)}",
        f"skipped:  {len(summary.skipped):,}",
    ]
    lines += [f"  {path}: {reason}" for path, reason in summary.skipped]
    return "\n".join(lines)


def run_imagefolder(args: argparse.Namespace) -> int:
    """Convert ``args.src`` to ``args.dst`` and print the summary; 1 with a one-line message on error."""
    from stoker.cli._errors import error_message
    from stoker.convert.imagefolder import convert_image_folder
    from stoker.errors import StokerError

    try:
        summary = convert_image_folder(
            args.src,
            args.dst,
            write_mode=args.write_mode,
            max_resolution=args.max_resolution,
            jpeg_quality=args.jpeg_quality,
            compress_probability=args.compress_probability,
            num_workers=args.num_workers,
            skip_bad=args.skip_bad,
            progress=False if args.quiet else None,
            reencode=args.reencode,
        )
    except (StokerError, OSError, ValueError) as exc:
        print(f"stoker convert imagefolder: error: {error_message(exc, writing=args.dst, reading=args.src)}", file=sys.stderr)
        return 1
    print(summary_text(summary))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``convert`` sub-command (with one sub-command per source layout) to a ``stoker`` argument parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "convert", help="write a stoker file from another layout (an image folder)", description=__doc__.split("\n\n")[2]
    )
    sources = parser.add_subparsers(title="sources", metavar="SOURCE", dest="source", required=True)
    folder = sources.add_parser(
        "imagefolder",
        help="a class-per-folder image tree (SRC/<class>/<image>), as torchvision's ImageFolder",
        description="Write the images below SRC/<class>/ to DST with the fields image (RGB) and label (the index of the class folder "
        "in sorted order), and the class names to DST.classes.json.",
    )
    folder.add_argument("src", metavar="SRC", help="the folder with one sub-folder per class")
    folder.add_argument("dst", metavar="DST", help="the stoker file to write (replaced if it exists)")
    folder.add_argument(
        "--write-mode",
        choices=_WRITE_MODES,
        default="smart",
        help="raw: uncompressed; jpg: always JPEG; smart: JPEG when the image has more than 64*64 pixels and the JPEG is smaller; "
        "proportion: JPEG for a --compress-probability share of the images (default: smart)",
    )
    folder.add_argument(
        "--max-resolution", type=_positive_int, default=None, metavar="N", help="downscale so that the longer side is at most N pixels"
    )
    folder.add_argument("--jpeg-quality", type=_quality, default=90, metavar="Q", help="JPEG quality, 1..100 (default: 90)")
    folder.add_argument(
        "--compress-probability",
        type=_probability,
        default=0.5,
        metavar="P",
        help="share of JPEG-compressed images with --write-mode proportion (default: 0.5)",
    )
    folder.add_argument(
        "--num-workers",
        type=_workers,
        default=-1,
        metavar="N",
        help="decoding and encoding processes; -1: one per CPU, or none for JPEGs copied as they are (default)",
    )
    folder.add_argument(
        "--skip-bad", action="store_true", help="check every image first; leave out and list those that cannot be read instead of failing"
    )
    folder.add_argument(
        "--reencode",
        action="store_true",
        help="decode and re-encode every image, also the JPEGs that are otherwise stored as they are (byte for byte)",
    )
    folder.add_argument("--quiet", action="store_true", help="no progress bars (the summary is still printed)")
    folder.set_defaults(func=run_imagefolder)
