"""Training comparison: the notebook's MLP on the Otto table, fed by stoker and by the DataLoader, in alternating rounds.

The notebook times the gap between consecutive batches of a loop that runs
the forward pass and the loss. Here the loop is a real training step
(forward, loss, backward, Adam step); the timing is the notebook's: the time
between consecutive batches, the first 10 batches of each epoch left out. One
untimed warm-up epoch per system comes first (stoker compiles its pipeline
there); its batches are fingerprinted and checked against the dataset
(every kept sample once, none foreign), so a system that trains on wrong
data reports no time.

Each system is a :class:`Trainer` (its loader, its own model and optimizer).
After the warm-ups, :func:`train_rounds` trains them in alternating rounds (one
or more epochs of each per round, ``A B C`` then ``C B A``): a system's median
step in a round is compared with another's in the same round, so a load that
comes and goes on the machine hits both (see :mod:`stoker.bench.rounds`).

The time to the first batch is taken as the user waits for it: from ``iter()``
(which starts a DataLoader's workers, and compiles and starts stoker's
producers) to the first batch in hand.

Systems: ``STOKER`` (the stoker ``Loader``), ``TORCH`` (the notebook's
``DataLoader``, one ``__getitem__`` per sample, 1 worker, kept between
epochs) and ``TORCH_BATCHED`` (a ``DataLoader`` over a dataset with a batched
``__getitems__``: one call per batch, 0 workers, its faster setting in the
loading comparison on this kind of table).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from stoker.bench.data import fingerprints
from stoker.bench.loading import check_batch, check_epoch_fingerprints
from stoker.bench.rounds import describe, order, spread, verdict

#: the systems of the training table, in its order; the first is stoker
SYSTEMS = ("STOKER", "TORCH", "TORCH_BATCHED")

#: batches at the start of each epoch left out of the timing, as in the notebook (``if i > 10``)
SKIP_BATCHES = 10


class MySuperPooperNetwork(nn.Module):
    """The notebook's 3-layer MLP: ``in -> 256 -> 256 -> out`` with ReLUs."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(in_features, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@dataclass(frozen=True)
class TrainResult:
    """Per-batch times of one system's training loop.

    Attributes:
        name: one of :data:`SYSTEMS`.
        times: time between consecutive batches, every timed epoch [seconds].
        batch_size: samples per batch.
        losses: the loss of the last batch of each epoch.
        rounds: the median of ``times`` in each round [seconds] (one value when not run in rounds).
        first_batch_s: the warm-up epoch's first batch, from ``iter()`` (the user's first wait) [seconds].
        epoch_first_batch_s: each timed epoch's first batch, from ``iter()`` [seconds].
    """

    name: str
    times: list[float]
    batch_size: int
    losses: list[float]
    rounds: list[float] = field(default_factory=list)
    first_batch_s: float = float("nan")
    epoch_first_batch_s: list[float] = field(default_factory=list)

    def stats(self) -> dict[str, float]:
        """Mean, median and 0.95-quantile [seconds], samples/s (batch size over the mean), first batches [seconds]."""
        t = np.asarray(self.times)
        return {
            "mean_s": float(t.mean()),
            "median_s": float(np.median(t)),
            "q95_s": float(np.quantile(t, 0.95)),
            "samples_per_s": self.batch_size / float(t.mean()),
            "first_batch_s": self.first_batch_s,
            "epoch_first_batch_median_s": float(np.median(self.epoch_first_batch_s)) if self.epoch_first_batch_s else float("nan"),
        }


class Trainer:
    """One system's training: its loader, a fresh MLP (seeded) and its Adam optimizer; one epoch at a time.

    Args:
        name: the row name in the table.
        loader: yields ``(x, y)`` batches; iterated once per epoch.
        batch_size: samples per batch (checked on every batch).
        num_features: columns of x.
        device: where the model runs.
        seed: seeds the model's initial weights.
        reference: :func:`~stoker.bench.data.fingerprints` of the dataset; the
            warm-up epoch's samples are checked against them.
    """

    def __init__(
        self,
        name: str,
        loader: Any,
        batch_size: int,
        num_features: int,
        device: torch.device,
        seed: int,
        reference: np.ndarray | None = None,
    ) -> None:
        self.name, self.loader, self.batch_size, self.num_features = name, loader, batch_size, num_features
        self.device, self.reference = device, reference
        torch.manual_seed(seed)
        self.model = MySuperPooperNetwork(num_features, 9).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), 5e-4)
        self.criterion = nn.CrossEntropyLoss()
        self.times: list[float] = []
        self.losses: list[float] = []
        self.rounds: list[float] = []
        self.first_batch_s = float("nan")
        self.epoch_first_batch_s: list[float] = []

    def epoch(self, timed: bool) -> list[float]:
        """Train one epoch; returns its timed gaps between batches (none for the warm-up, ``timed=False``, whose
        samples are checked instead).

        Raises:
            BenchCheckError: a batch of the wrong shape or dtype, or a warm-up
                epoch whose samples are not the dataset's.
        """
        model, optimizer, criterion, device = self.model, self.optimizer, self.criterion, self.device
        cuda = device.type == "cuda"
        reference = None if timed else self.reference
        times: list[float] = []
        seen: list[np.ndarray] = []
        loss = None
        start = time.perf_counter()
        now = start
        for i, b in enumerate(iter(self.loader)):  # (from iter(): a DataLoader starts its workers, stoker its producers)
            if i == 0:
                first = time.perf_counter() - start
                if timed:
                    self.epoch_first_batch_s.append(first)
                elif math.isnan(self.first_batch_s):
                    self.first_batch_s = first
            x, y = check_batch(b, self.batch_size, self.num_features, self.name)
            if reference is not None:
                seen.append(fingerprints(x.numpy(), y.numpy().reshape(-1)))
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).flatten()
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            if timed and i > SKIP_BATCHES:
                times.append(time.perf_counter() - now)
            now = time.perf_counter()
        if loss is not None:
            self.losses.append(loss.item())
        if reference is not None:
            check_epoch_fingerprints(seen, reference, self.batch_size, f"training, {self.name}")
        self.times.extend(times)
        return times

    def result(self) -> TrainResult:
        """The timed epochs so far.

        Raises:
            FloatingPointError: the loss is not finite.
            ValueError: no batch was timed.
        """
        if not self.losses or not all(np.isfinite(self.losses)):
            raise FloatingPointError(f"{self.name}: training loss is not finite: {self.losses}")
        if not self.times:
            raise ValueError(f"{self.name}: no batch was timed; epochs need more than {SKIP_BATCHES + 1} batches")
        rounds = self.rounds or [statistics.median(self.times)]
        return TrainResult(
            self.name,
            list(self.times),
            self.batch_size,
            list(self.losses),
            list(rounds),
            self.first_batch_s,
            list(self.epoch_first_batch_s),
        )


def train_timed(
    name: str,
    loader: Any,
    epochs: int,
    batch_size: int,
    num_features: int,
    device: torch.device,
    seed: int,
    reference: np.ndarray | None = None,
) -> TrainResult:
    """Train a fresh MLP for ``1 + epochs`` epochs and time the batches of the last ``epochs`` (one system alone).

    Raises:
        BenchCheckError: a batch of the wrong shape or dtype, or a warm-up
            epoch whose samples are not the dataset's.
        FloatingPointError: the loss is not finite.
    """
    trainer = Trainer(name, loader, batch_size, num_features, device, seed, reference)
    trainer.epoch(timed=False)
    for _ in range(epochs):
        trainer.epoch(timed=True)
    return trainer.result()


def train_rounds(
    trainers: dict[str, Trainer],
    rounds: int,
    epochs_per_round: int,
    log: Callable[[str], None] = lambda s: None,
    after_round: Callable[[int], Any] | None = None,
) -> list[Any]:
    """Train warmed-up systems in alternating rounds: ``epochs_per_round`` epochs of each per round.

    Each trainer's ``rounds`` gets its median step of every round. ``after_round(r)`` is called at the end of
    each round (the load monitor's window); its results are returned, one per round.
    """
    names = list(trainers)
    marks = []
    for r in range(rounds):
        for name in order(names, r):
            t = trainers[name]
            times: list[float] = []
            for _ in range(epochs_per_round):
                times.extend(t.epoch(timed=True))
            t.rounds.append(statistics.median(times))
        if after_round is not None:
            marks.append(after_round(r))
        log(f"training: round {r + 1}/{rounds}: " + ", ".join(f"{n} {trainers[n].rounds[-1] * 1e3:.1f} ms" for n in names))
    return marks


def uplift(stoker: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """The notebook's ``UPLIFT (%)`` row: ``(stoker - other) / other * 100`` per statistic."""
    return {k: (stoker[k] - other[k]) / other[k] * 100 for k in ("mean_s", "median_s", "q95_s")}


def device() -> torch.device:
    """CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_trainer(X: np.ndarray, y: np.ndarray, batch_size: int, seed: int, reference: np.ndarray | None = None) -> Trainer:
    """The notebook's DataLoader (1 worker, ``pin_memory`` on CUDA), shuffled, ``drop_last=True``.

    Its worker is kept between epochs (``persistent_workers``): started by the first ``iter()``, so that the rounds
    can alternate it with stoker without forking a process beside stoker's threads. Run its warm-up epoch before
    stoker has started threads in this process.
    """
    from torch.utils.data import DataLoader

    from stoker.bench.data import OttoDataset

    dev = device()
    dataset: Any = OttoDataset(X, y)
    torch_loader: DataLoader[Any] = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=1,
        persistent_workers=True,
        pin_memory=dev.type == "cuda",
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return Trainer("TORCH", torch_loader, batch_size, X.shape[1], dev, seed, reference)


def torch_batched_trainer(X: np.ndarray, y: np.ndarray, batch_size: int, seed: int, reference: np.ndarray | None = None) -> Trainer:
    """A DataLoader over a batched ``__getitems__`` dataset (0 workers), shuffled, ``drop_last=True``."""
    from stoker.bench.baselines import dataloader_batched

    return Trainer("TORCH_BATCHED", dataloader_batched(X, y, batch_size, 0, seed), batch_size, X.shape[1], device(), seed, reference)


def stoker_trainer(
    path: Any, num_features: int, batch_size: int, num_workers: int, seed: int, reference: np.ndarray | None = None
) -> Trainer:
    """The stoker ``Loader``: random order, ``drop_last=True``, default pipelines (close ``trainer.loader`` after)."""
    from stoker.bench.loading import stoker_loader

    return Trainer("STOKER", stoker_loader(path, batch_size, num_workers, seed), batch_size, num_features, device(), seed, reference)


def training_summary(results: dict[str, TrainResult]) -> dict[str, Any]:
    """The notebook's table as a dict, with an UPLIFT row, and each DataLoader's speed-up ratio over the rounds.

    Args:
        results: by name; ``STOKER`` and at least one other system, with the same number of ``rounds``.

    Returns:
        ``{"device", "skip_batches", "batches_timed", "rounds", "final_loss", "systems": {name: stats},
        "uplift_percent": {other: {stat: %}}, "speedup_median": {other: ratio}, "speedup_rounds": {other: spread},
        "verdict": {other: "faster" | "slower" | "on par"}}``: a round's ratio is the other system's median step
        over STOKER's in that round; ``speedup_median`` is the median of the rounds' ratios and ``speedup_rounds``
        their spread (:func:`stoker.bench.rounds.spread`).
    """
    stats = {name: r.stats() for name, r in results.items()}
    others = [name for name in results if name != "STOKER"]
    mine = results["STOKER"].rounds
    ratios = {name: spread([o / s for o, s in zip(results[name].rounds, mine, strict=True)]) for name in others}
    return {
        "device": str(device()),
        "skip_batches": SKIP_BATCHES,
        "batches_timed": {name: len(r.times) for name, r in results.items()},
        "rounds": len(mine),
        "final_loss": {name: r.losses[-1] for name, r in results.items()},
        "systems": stats,
        "uplift_percent": {name: uplift(stats["STOKER"], stats[name]) for name in others},
        "speedup_median": {name: ratios[name]["median"] for name in others},
        "speedup_rounds": ratios,
        "verdict": {name: verdict(ratios[name]) for name in others},
        "summary": {name: describe(ratios[name]) for name in others},
    }
