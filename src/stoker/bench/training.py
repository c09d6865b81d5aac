"""Training comparison: the notebook's MLP on the Otto table, fed by stoker and by the DataLoader.

The notebook times the gap between consecutive batches of a loop that runs
the forward pass and the loss. Here the loop is a real training step
(forward, loss, backward, Adam step); the timing is the notebook's: the time
between consecutive batches, the first 10 batches of each epoch left out. One
untimed warm-up epoch per system comes first (stoker compiles its pipeline
there).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stoker.bench.loading import check_batch

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
        name: ``"STOKER"`` or ``"TORCH"``.
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


def train_timed(name: str, loader: Any, epochs: int, batch_size: int, num_features: int, device: torch.device, seed: int) -> TrainResult:
    """Train a fresh MLP for ``1 + epochs`` epochs and time the batches of the last ``epochs``.

    Args:
        name: the row name in the table.
        loader: yields ``(x, y)`` batches; iterated once per epoch.
        epochs: timed epochs (after one warm-up epoch).
        batch_size: samples per batch (checked on every batch).
        num_features: columns of x.
        device: where the model runs.
        seed: seeds the model's initial weights.

    Raises:
        BenchCheckError: a batch of the wrong shape or dtype.
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
        for i, b in enumerate(loader):
            x, y = check_batch(b, batch_size, num_features, name)
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
    if not losses or not all(np.isfinite(losses)):
        raise FloatingPointError(f"{name}: training loss is not finite: {losses}")
    if not times:
        raise ValueError(f"{name}: no batch was timed; epochs need more than {SKIP_BATCHES + 1} batches")
    return TrainResult(name, times, batch_size, losses)


def uplift(stoker: dict[str, float], torch_: dict[str, float]) -> dict[str, float]:
    """The notebook's ``UPLIFT (%)`` row: ``(stoker - torch) / torch * 100`` per statistic."""
    return {k: (stoker[k] - torch_[k]) / torch_[k] * 100 for k in ("mean_s", "median_s", "q95_s")}


def device() -> torch.device:
    """CUDA when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train_torch(X: np.ndarray, y: np.ndarray, batch_size: int, epochs: int, seed: int) -> TrainResult:
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
    return train_timed("TORCH", torch_loader, epochs, batch_size, X.shape[1], dev, seed)


def train_stoker(path: Any, num_features: int, batch_size: int, epochs: int, num_workers: int, seed: int) -> TrainResult:
    """Train with the stoker ``Loader``: random order, ``drop_last=True``, default pipelines."""
    from stoker.bench.loading import stoker_loader

    loader = stoker_loader(path, batch_size, num_workers, seed)
    try:
        return train_timed("STOKER", loader, epochs, batch_size, num_features, device(), seed)
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()


def training_summary(stoker_res: TrainResult, torch_res: TrainResult) -> dict[str, Any]:
    """The notebook's table as a dict, plus the median speed-up (TORCH / STOKER).

    Returns:
        ``{"device", "skip_batches", "batches_timed", "final_loss", "systems": {"STOKER": stats, "TORCH": stats},
        "uplift_percent", "speedup_median"}``.
    """
    stats = {"STOKER": stoker_res.stats(), "TORCH": torch_res.stats()}
    return {
        "device": str(device()),
        "skip_batches": SKIP_BATCHES,
        "batches_timed": {"STOKER": len(stoker_res.times), "TORCH": len(torch_res.times)},
        "final_loss": {"STOKER": stoker_res.losses[-1], "TORCH": torch_res.losses[-1]},
        "systems": stats,
        "uplift_percent": uplift(stats["STOKER"], stats["TORCH"]),
        "speedup_median": statistics.median(torch_res.times) / statistics.median(stoker_res.times),
    }
