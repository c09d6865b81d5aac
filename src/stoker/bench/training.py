"""Training comparison: the notebook's MLP on the Otto table, fed by stoker and by the DataLoader.

The notebook times the gap between consecutive batches of a loop that runs
the forward pass and the loss. Here the loop is a real training step
(forward, loss, backward, Adam step); the timing is the notebook's: the time
between consecutive batches, the first 10 batches of each epoch left out. One
untimed warm-up epoch per system comes first (stoker compiles its pipeline
there); its batches are fingerprinted and checked against the dataset
(every kept sample once, none foreign), so a system that trains on wrong
data reports no time.

Systems: ``STOKER`` (the stoker ``Loader``), ``TORCH`` (the notebook's
``DataLoader``, one ``__getitem__`` per sample, 1 worker) and
``TORCH_BATCHED`` (a ``DataLoader`` over a dataset with a batched
``__getitems__``: one call per batch, 0 workers, its faster setting in the
loading comparison on this kind of table).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stoker.bench.data import fingerprints
from stoker.bench.loading import check_batch, check_epoch_fingerprints

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
        times: time between consecutive batches [seconds].
        batch_size: samples per batch.
        losses: the loss of the last batch of each epoch.
    """

    name: str
    times: list[float]
    batch_size: int
    losses: list[float]

    def stats(self) -> dict[str, float]:
        """Mean, median and 0.95-quantile [seconds] and samples/s (batch size over the mean)."""
        t = np.asarray(self.times)
        return {
            "mean_s": float(t.mean()),
            "median_s": float(np.median(t)),
            "q95_s": float(np.quantile(t, 0.95)),
            "samples_per_s": self.batch_size / float(t.mean()),
        }


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
    """Train a fresh MLP for ``1 + epochs`` epochs and time the batches of the last ``epochs``.

    Args:
        name: the row name in the table.
        loader: yields ``(x, y)`` batches; iterated once per epoch.
        epochs: timed epochs (after one warm-up epoch).
        batch_size: samples per batch (checked on every batch).
        num_features: columns of x.
        device: where the model runs.
        seed: seeds the model's initial weights.
        reference: :func:`~stoker.bench.data.fingerprints` of the dataset; the
            warm-up epoch's samples are checked against them.

    Raises:
        BenchCheckError: a batch of the wrong shape or dtype, or a warm-up
            epoch whose samples are not the dataset's.
        FloatingPointError: the loss is not finite.
    """
    torch.manual_seed(seed)
    model = MySuperPooperNetwork(num_features, 9).to(device)
    optimizer = torch.optim.Adam(model.parameters(), 5e-4)
    criterion = nn.CrossEntropyLoss()
    cuda = device.type == "cuda"
    times: list[float] = []
    losses: list[float] = []
    now = time.perf_counter()
    for j in range(1 + epochs):
        loss = None
        seen: list[np.ndarray] = []
        for i, b in enumerate(loader):
            x, y = check_batch(b, batch_size, num_features, name)
            if j == 0 and reference is not None:  # the warm-up epoch is not timed
                seen.append(fingerprints(x.numpy(), y.numpy().reshape(-1)))
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).flatten()
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            if j > 0 and i > SKIP_BATCHES:
                times.append(time.perf_counter() - now)
            now = time.perf_counter()
        if loss is not None:
            losses.append(loss.item())
        if j == 0 and reference is not None:
            check_epoch_fingerprints(seen, reference, batch_size, f"training, {name}")
            now = time.perf_counter()
    if not losses or not all(np.isfinite(losses)):
        raise FloatingPointError(f"{name}: training loss is not finite: {losses}")
    if not times:
        raise ValueError(f"{name}: no batch was timed; epochs need more than {SKIP_BATCHES + 1} batches")
    return TrainResult(name, times, batch_size, losses)


def uplift(stoker: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """The notebook's ``UPLIFT (%)`` row: ``(stoker - other) / other * 100`` per statistic."""
    return {k: (stoker[k] - other[k]) / other[k] * 100 for k in ("mean_s", "median_s", "q95_s")}


def device() -> torch.device:
    """CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train_torch(X: np.ndarray, y: np.ndarray, batch_size: int, epochs: int, seed: int, reference: np.ndarray | None = None) -> TrainResult:
    """Train with the notebook's DataLoader (1 worker, ``pin_memory`` on CUDA), shuffled, ``drop_last=True``.

    It forks a worker process each epoch: run it before stoker has started threads.
    """
    from torch.utils.data import DataLoader

    from stoker.bench.data import OttoDataset

    dev = device()
    dataset: Any = OttoDataset(X, y)
    torch_loader: DataLoader[Any] = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=1,
        pin_memory=dev.type == "cuda",
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return train_timed("TORCH", torch_loader, epochs, batch_size, X.shape[1], dev, seed, reference)


def train_torch_batched(
    X: np.ndarray, y: np.ndarray, batch_size: int, epochs: int, seed: int, reference: np.ndarray | None = None
) -> TrainResult:
    """Train with a DataLoader over a batched ``__getitems__`` dataset (0 workers), shuffled, ``drop_last=True``."""
    from stoker.bench.baselines import dataloader_batched

    return train_timed(
        "TORCH_BATCHED", dataloader_batched(X, y, batch_size, 0, seed), epochs, batch_size, X.shape[1], device(), seed, reference
    )


def train_stoker(
    path: Any, num_features: int, batch_size: int, epochs: int, num_workers: int, seed: int, reference: np.ndarray | None = None
) -> TrainResult:
    """Train with the stoker ``Loader``: random order, ``drop_last=True``, default pipelines."""
    from stoker.bench.loading import stoker_loader

    loader = stoker_loader(path, batch_size, num_workers, seed)
    try:
        return train_timed("STOKER", loader, epochs, batch_size, num_features, device(), seed, reference)
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()


def training_summary(results: dict[str, TrainResult]) -> dict[str, Any]:
    """The notebook's table as a dict, with an UPLIFT row and the median speed-up against each DataLoader.

    Args:
        results: by name; ``STOKER`` and at least one other system.

    Returns:
        ``{"device", "skip_batches", "batches_timed", "final_loss", "systems": {name: stats},
        "uplift_percent": {other: {stat: %}}, "speedup_median": {other: other's median / STOKER's median}}``.
    """
    stats = {name: r.stats() for name, r in results.items()}
    others = [name for name in results if name != "STOKER"]
    stoker_median = statistics.median(results["STOKER"].times)
    return {
        "device": str(device()),
        "skip_batches": SKIP_BATCHES,
        "batches_timed": {name: len(r.times) for name, r in results.items()},
        "final_loss": {name: r.losses[-1] for name, r in results.items()},
        "systems": stats,
        "uplift_percent": {name: uplift(stats["STOKER"], stats[name]) for name in others},
        "speedup_median": {name: statistics.median(results[name].times) / stoker_median for name in others},
    }
