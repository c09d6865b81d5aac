"""The Otto benchmark: dataset, training comparison, loader-only comparison, time to first batch.

Lifecycle: :class:`BenchConfig` (validated data) -> :func:`run_otto_bench`
(returns a JSON-ready dict, raises if any system fails its checks) ->
:func:`stoker.bench.report.write_outputs`.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoker._threads import available_cpus
from stoker.bench.data import OTTO_FEATURES, OTTO_SAMPLES


@dataclass(frozen=True)
class BenchConfig:
    """What ``stoker bench`` runs.

    Attributes:
        out: folder for the dataset and the results.
        num_samples: rows of the Otto table.
        batch_size: samples per batch.
        train_epochs: timed training epochs per system (after one warm-up).
        load_epochs: timed loading epochs per system (after the first).
        slow_epochs: the same for the per-sample DataLoader, which is slow.
        num_workers: the stoker loader's threads in the training comparison.
        stoker_workers: the thread counts of the stoker rows in the loading comparison.
        seed: seeds the table, the orders and the model.
        startup: also time the first batch in fresh processes.
        rounds: alternating rounds of the training and loading comparisons (each system gets
            ``epochs // rounds`` epochs a round, at least one).
    """

    out: Path
    num_samples: int = OTTO_SAMPLES
    batch_size: int = 1024
    train_epochs: int = 20
    load_epochs: int = 50
    slow_epochs: int = 10
    num_workers: int = 1
    stoker_workers: tuple[int, ...] = field(default_factory=lambda: tuple(sorted({1, min(2, available_cpus())})))
    seed: int = 0
    startup: bool = True
    rounds: int = 10

    def __post_init__(self) -> None:
        for name in ("batch_size", "train_epochs", "load_epochs", "slow_epochs", "num_workers", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}")
        if not self.stoker_workers or any(w < 1 for w in self.stoker_workers):
            raise ValueError(f"`stoker_workers` must be a non-empty list of integers >= 1; got {self.stoker_workers!r}")
        if self.num_samples < (2 + 10) * self.batch_size:
            raise ValueError(
                f"`num_samples` must give at least 12 batches of {self.batch_size} (the first 10 of an epoch are not timed); "
                f"got {self.num_samples}: use at least {12 * self.batch_size} samples or a smaller batch"
            )

    @classmethod
    def quick(cls, out: Path, **overrides: Any) -> BenchConfig:
        """Small sizes for tests: 16,384 samples, 2 rounds of 1 epoch per system (about 30 s on 2 cores)."""
        settings: dict[str, Any] = {"num_samples": 16 * 1024, "train_epochs": 2, "load_epochs": 2, "slow_epochs": 2, "rounds": 2}
        settings.update(overrides)
        return cls(out=out, **settings)


def machine_info() -> dict[str, Any]:
    """Versions and hardware the numbers were measured on."""
    import numba
    import numpy
    import torch

    return {
        "platform": platform.platform(terse=True),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "numba": numba.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "date": datetime.date.today().isoformat(),
    }


def _check_startup_shapes(startup: dict[str, Any], batch_size: int) -> None:
    from stoker.bench.loading import BenchCheckError

    for run, r in startup.items():
        x_shape, x_dtype, y_shape, y_dtype = r["shape"]
        kind = "" if "numpy" in run else "torch."  # numpy batches print their dtypes as 'float32', 'int64'
        if (
            x_shape != [batch_size, OTTO_FEATURES]
            or x_dtype != kind + "float32"
            or y_shape not in ([batch_size], [batch_size, 1])
            or y_dtype != kind + "int64"
        ):
            raise BenchCheckError(f"time to first batch ({run}): the first batch is x {x_shape} {x_dtype}, y {y_shape} {y_dtype}")
        reported = r.get("report_first_batch_s")
        if reported is not None and not 0 < reported <= r["first_batch_s"]:  # (both from iter(): the report's inside the span)
            raise BenchCheckError(
                f"time to first batch ({run}): report() says {reported:.3f} s from iter() to the first batch, outside the "
                f"{r['first_batch_s']:.3f} s measured around iter() and next()"
            )


def run_otto_bench(config: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run the whole benchmark.

    Every system is built, warmed up and checked first; then the loading systems are timed in alternating
    rounds, then the training systems (see :mod:`stoker.bench.rounds`), while a
    :class:`~stoker.bench.load.LoadMonitor` samples the load of other work. What forks (DataLoader workers,
    kept between epochs) starts before stoker has started threads in this process.

    Args:
        config: what to run.
        log: receives one line per step (progress).

    Returns:
        A JSON-ready dict: ``machine`` (with ``load``: other work's load over the run and each round),
        ``config``, ``dataset``, ``training``, ``loading``, ``verdicts`` and (unless disabled) ``startup``.

    Raises:
        BenchCheckError: a system produced wrong batches; no number is returned.
        StartupError: the time-to-first-batch child failed.
    """
    from stoker.bench.data import fingerprints, write_otto
    from stoker.bench.load import LoadMonitor
    from stoker.bench.loading import _close, add_ratios, compare_loading_rounds, loading_specs, prepare_system, thread_round_trips_us
    from stoker.bench.startup import time_to_first_batch
    from stoker.bench.training import stoker_trainer, torch_batched_trainer, torch_trainer, train_rounds, training_summary

    with LoadMonitor() as monitor:
        log(f"dataset: {config.num_samples:,} x {OTTO_FEATURES} Otto-shaped table in {config.out} ...")
        otto = write_otto(config.out, config.num_samples, config.seed)
        reference = fingerprints(otto.X, otto.y)
        data = (otto.X, otto.y)
        specs = loading_specs(
            otto.path, otto.X, otto.y, config.batch_size, list(config.stoker_workers), config.load_epochs, config.slow_epochs, config.seed
        )
        prepared: dict[str, Any] = {}
        trainers: dict[str, Any] = {}
        try:
            # Everything that forks (DataLoader workers, kept between epochs) starts before stoker starts its threads.
            for spec in [s for s in specs if not s.key.startswith("stoker")]:
                log(f"loading: {spec.label}: first epoch and checks ...")
                prepared[spec.key] = prepare_system(spec, reference, config.batch_size, OTTO_FEATURES, data)
            log("training: the DataLoaders' warm-up epochs (checked) ...")
            trainers["TORCH"] = torch_trainer(otto.X, otto.y, config.batch_size, config.seed, reference)
            trainers["TORCH_BATCHED"] = torch_batched_trainer(otto.X, otto.y, config.batch_size, config.seed, reference)
            for t in trainers.values():
                t.epoch(timed=False)
            for spec in [s for s in specs if s.key.startswith("stoker")]:
                log(f"loading: {spec.label}: first epoch, checks, compiled code ...")
                prepared[spec.key] = prepare_system(spec, reference, config.batch_size, OTTO_FEATURES, data)
                if prepared[spec.key].compile_s >= 1.0:
                    log(f"loading: {spec.label}: compiled in {prepared[spec.key].compile_s:.1f} s (the rounds time compiled epochs)")
            monitor.window()
            log(f"loading: {len(prepared)} systems in {config.rounds} alternating rounds ...")
            loading, load_rounds = compare_loading_rounds(
                prepared, config.rounds, config.batch_size, OTTO_FEATURES, log, lambda r: monitor.window().to_dict()
            )
            add_ratios(loading)
            log("training: stoker's warm-up epoch (checked) ...")
            trainers = {
                "STOKER": stoker_trainer(otto.path, OTTO_FEATURES, config.batch_size, config.num_workers, config.seed, reference),
                **trainers,
            }
            trainers["STOKER"].epoch(timed=False)
            monitor.window()
            log(f"training: {len(trainers)} systems in {config.rounds} alternating rounds ...")
            epochs = max(1, config.train_epochs // config.rounds)
            train_load = train_rounds(trainers, config.rounds, epochs, log, lambda r: monitor.window().to_dict())
            training = training_summary({name: trainers[name].result() for name in ("STOKER", "TORCH", "TORCH_BATCHED")})
        finally:
            for p in prepared.values():
                if p.loader is not None:
                    _close(p.loader)
            for t in trainers.values():
                _close(t.loader)
            prepared.clear()
            trainers.clear()  # (a DataLoader's kept workers end when it is collected: before the fresh processes below)
            gc.collect()
        startup = None
        if config.startup:
            log("time to first batch: fresh processes ...")
            startup = time_to_first_batch(otto.path, config.batch_size, config.num_workers, config.out / "numba-cache")
            _check_startup_shapes(startup, config.batch_size)
    cfg = asdict(config)
    cfg["out"] = str(config.out)
    cfg["stoker_workers"] = list(config.stoker_workers)
    machine = machine_info()
    machine["thread_round_trip_us"] = thread_round_trips_us()
    load = monitor.summary()
    load["rounds"] = {"loading": load_rounds, "training": train_load}
    machine["load"] = load
    machine["loadavg_1min"] = load["loadavg_1min"]
    training["load_rounds"] = train_load
    results: dict[str, Any] = {
        "machine": machine,
        "argv": sys.argv,
        "config": cfg,
        "dataset": {
            "path": str(otto.path),
            "num_samples": len(otto.X),
            "num_features": OTTO_FEATURES,
            "file_bytes": otto.file_bytes,
            "reused": otto.reused,
            "write_s": otto.write_s,
        },
        "training": training,
        "loading": {"limit": "numpy_take", "compiled_limit": "compiled_gather", "systems": {k: r.to_dict() for k, r in loading.items()}},
        "startup": startup,
    }
    results["verdicts"] = verdicts(results, loading)
    return results


def verdicts(results: dict[str, Any], loading: dict[str, Any]) -> list[dict[str, Any]]:
    """The comparisons the job answers, each a speed ratio over the rounds with its spread and verdict.

    Training: stoker's step against each DataLoader's. Loading: stoker with the most threads against the
    compiled gather (the one-thread limit) and against the fastest DataLoader.
    """
    from stoker.bench.loading import speed_ratio_rounds
    from stoker.bench.rounds import describe, verdict

    out = []
    labels = {"TORCH": "the per-sample DataLoader (1 worker)", "TORCH_BATCHED": "the batched DataLoader (0 workers)"}
    for name, ratio in results["training"]["speedup_rounds"].items():
        out.append({"what": f"training step, stoker vs {labels.get(name, name)}", "ratio": ratio, "verdict": verdict(ratio)})
    stoker = [k for k in loading if k.startswith("stoker_w")]
    if stoker:
        mine = loading[max(stoker, key=lambda k: loading[k].workers)]
        torch = [r for k, r in loading.items() if k.startswith("torch")]
        rivals = [("compiled_gather", loading.get("compiled_gather"))]
        if torch:
            best = max(torch, key=lambda r: r.samples_per_s)
            rivals.append((best.key, best))
        for key, rival in rivals:
            if rival is not None:
                ratio = speed_ratio_rounds(mine, rival)
                out.append({"what": f"loading, {mine.label} vs {rival.label}", "ratio": ratio, "verdict": verdict(ratio), "key": key})
    for v in out:
        v["summary"] = describe(v["ratio"])
    return out
