"""``stoker warmup``: compile ahead of a job, so that it waits for no compiler.

``stoker warmup DATASET [DATASET ...]`` builds a loader over each dataset (each
field's default pipeline, or ``--pipelines module:name``: a dict of pipelines, or
a function returning one) and compiles everything its epochs run into the disk
caches (``Loader.compile()``): run it when building a container image, with the
caches inside the image. ``stoker warmup --library`` compiles stoker's own
kernels for the generic CPU into the package's prebuilt folder (``make prebuilt``:
once, when a wheel is built). Errors print one line to stderr and exit with code 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``warmup`` sub-command to a ``stoker`` argument parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "warmup",
        help="compile a dataset's pipelines (or stoker's own kernels) ahead of a job",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("datasets", nargs="*", type=Path, help="stoker files or folders of shards")
    parser.add_argument(
        "--pipelines", help="module:name of a dict of pipelines (or of a function returning one); a .py file path works too"
    )
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=None, help="the loader's threads (default: its default)")
    parser.add_argument("--library", action="store_true", help="compile stoker's own kernels for the generic CPU (prebuilt, for wheels)")
    parser.add_argument(
        "--out", type=Path, default=None, help="with --library: where to save them (default: the package's prebuilt folder)"
    )
    parser.set_defaults(func=run)


def load_pipelines(spec: str) -> Any:
    """The pipelines named by ``module:name`` (``path/to/file.py:name`` too): the value, or what calling it returns.

    Raises:
        ValueError: a spec without ``:``, a module or name that is not there.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--pipelines must be module:name (or file.py:name); got {spec!r}")
    try:
        if module_name.endswith(".py"):
            loaded = importlib.util.spec_from_file_location("stoker_warmup_pipelines", module_name)
            if loaded is None or loaded.loader is None:
                raise ImportError(module_name)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as exc:
        raise ValueError(f"--pipelines: cannot import {module_name!r}: {exc}") from exc
    if not hasattr(module, attr):
        raise ValueError(f"--pipelines: {module_name!r} has no {attr!r}")
    value = getattr(module, attr)
    return value() if callable(value) else value


def run(args: argparse.Namespace) -> int:
    """Compile for each dataset (or the library); the exit code."""
    from stoker.errors import StokerError

    if not args.library and not args.datasets:
        print("stoker warmup: give one or more datasets, or --library", file=sys.stderr)
        return 2
    try:
        if args.library:
            from stoker.loader.warmup import build_library

            t0 = time.perf_counter()
            saved = build_library(args.out)
            print(f"prebuilt {len(saved)} kernel signatures in {time.perf_counter() - t0:.0f} s")
        pipelines = load_pipelines(args.pipelines) if args.pipelines else None
        from stoker.loader import Loader

        for path in args.datasets:
            options: dict[str, Any] = {"batch_size": args.batch_size, "pipelines": pipelines}
            if args.num_workers is not None:
                options["num_workers"] = args.num_workers
            loader = Loader(path, **options)
            try:
                seconds = loader.compile()
            finally:
                loader.close()
            print(f"{path}: compiled and cached in {seconds:.1f} s")
    except (StokerError, ValueError, OSError, RuntimeError) as exc:
        print(f"stoker warmup: {exc}", file=sys.stderr)
        return 1
    return 0
