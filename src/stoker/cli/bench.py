"""``stoker bench``: the Otto benchmark (wiring only; the work is in :mod:`stoker.bench`).

Builds an Otto-shaped table (no download), writes it as a stoker file, then
compares stoker with ``torch.utils.data.DataLoader`` in a training loop and
in loading alone, against two one-thread limits (numpy ``take`` and a compiled
gather), in alternating rounds (ratios: the median of the rounds, with their
spread; a warning when other work kept the machine busy), and times the first
batch in fresh processes. Writes ``otto.json``, ``otto.md`` and, when
matplotlib is installed, ``otto.png`` to ``--out`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, like 1,2; got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, like 1,2; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the dataset and the results (default: ./bench-out)")
    parser.add_argument("--quick", action="store_true", help="small sizes (16,384 samples, 2 rounds of 1 epoch): about 30 s, for tests")
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=None,
        help="timed epochs per system in the loading comparison (default 50, per-sample DataLoader 10; quick: 2)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        default=None,
        help="alternating rounds: each system's timed epochs are spread over them, ratios taken within each (default 10; quick: 2)",
    )
    parser.add_argument("--train-epochs", type=_positive_int, default=None, help="timed training epochs per system (default 20; quick: 2)")
    parser.add_argument(
        "--num-workers", type=_positive_int, default=1, help="stoker loader threads in the training comparison (default 1, as the notebook)"
    )
    parser.add_argument(
        "--stoker-workers",
        type=_int_list,
        default=None,
        help="comma-separated thread counts for the stoker rows of the loading comparison (default: 1,2)",
    )
    parser.add_argument("--batch-size", type=_positive_int, default=1024, help="samples per batch (default 1024)")
    parser.add_argument("--samples", type=_positive_int, default=None, help="rows of the Otto table (default 61,878; quick: 16,384)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the table, the orders and the model (default 0)")
    parser.add_argument("--no-startup", action="store_true", help="skip the time-to-first-batch runs in fresh processes")


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command to a ``stoker`` argument parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "bench", help="compare stoker with torch's DataLoader on an Otto-shaped table", description=__doc__.split("\n\n")[1]
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def _config(args: argparse.Namespace) -> Any:
    from stoker.bench.otto import BenchConfig

    overrides: dict[str, Any] = {
        "batch_size": args.batch_size,
        "num_workers": args.num_workers,
        "seed": args.seed,
        "startup": not args.no_startup,
    }
    if args.epochs is not None:
        overrides["load_epochs"] = args.epochs
        overrides["slow_epochs"] = min(args.epochs, 10)
    if args.train_epochs is not None:
        overrides["train_epochs"] = args.train_epochs
    if args.samples is not None:
        overrides["num_samples"] = args.samples
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    if args.stoker_workers is not None:
        overrides["stoker_workers"] = args.stoker_workers
    if args.quick:
        return BenchConfig.quick(args.out, **overrides)
    return BenchConfig(out=args.out, **overrides)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the markdown report.

    Returns:
        0 on success; 1 when a system failed its checks or a run failed (no
        number is printed then); 2 for invalid options.
    """
    try:
        config = _config(args)
    except ValueError as exc:
        print(f"stoker bench: {exc}", file=sys.stderr)
        return 2
    from stoker.bench.loading import BenchCheckError
    from stoker.bench.otto import run_otto_bench
    from stoker.bench.report import matplotlib_missing, to_markdown, write_outputs
    from stoker.bench.startup import StartupError

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from stoker.cli._errors import error_message

    try:
        results = run_otto_bench(config, log)
        paths = write_outputs(results, config.out)
    except (BenchCheckError, StartupError, FloatingPointError, OSError) as exc:
        print(f"stoker bench: FAILED, no numbers reported: {error_message(exc, writing=config.out)}", file=sys.stderr)
        return 1
    print(to_markdown(results))
    print("Results: " + ", ".join(str(p) for p in paths.values() if p is not None))
    note = matplotlib_missing()
    if note is not None:
        print(f"stoker bench: {note}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``stoker bench`` on its own: ``python -m stoker.cli.bench [options]``."""
    parser = argparse.ArgumentParser(prog="stoker bench", description=__doc__.split("\n\n")[1])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
