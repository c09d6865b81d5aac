"""The Otto notebook (FFCV vs the DataLoader), with ``ffcv`` replaced by ``stoker``.

The cells are the notebook's, in its order. Three changes: the data is drawn
here instead of ``np.load`` (an Otto-shaped table: 93 count features, 9
classes), the device is CUDA when there is one and the CPU otherwise, and the
loops train (backward and Adam step) instead of only computing the loss.

    python examples/otto_mlp.py --epochs 10          # the notebook's 10 epochs
    OTTO_EPOCHS=1 OTTO_SAMPLES=16384 python examples/otto_mlp.py
    python examples/otto_mlp.py --samples 100 --epochs 1   # a quick try: one batch of 100

It runs on any number of rows: a batch holds at most the table (a batch size
larger than the table gives one batch of every row), and the timings skip the
first batches (the notebook's 11, as warm-up) only when an epoch has more
than twice that many.
"""

import argparse
import os
import tempfile

# In [None]:
import numpy as np

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=int(os.environ.get("OTTO_EPOCHS", "3")), help="epochs per loader (the notebook: 10)")
parser.add_argument(
    "--samples", type=int, default=int(os.environ.get("OTTO_SAMPLES", "61878")), help="rows of the table (Otto: 61,878; any >= 1)"
)
parser.add_argument("--out", default=os.environ.get("OTTO_OUT") or tempfile.mkdtemp(prefix="otto-"), help="folder for my_easy_data.stoker")
args = parser.parse_args()
if args.samples < 1 or args.epochs < 1:
    parser.error(f"--samples and --epochs must be >= 1; got {args.samples} and {args.epochs}")


class OttoDataset:
    def __init__(self, num_samples=args.samples, seed=0):
        # The notebook loads ../data/otto_ll/X_num_train.npy and y_train.npy; we draw the same shape:
        # sparse non-negative counts, one mean per (class, feature).
        rng = np.random.default_rng(seed)
        self.y = rng.integers(0, 9, size=num_samples)
        means = rng.gamma(0.5, 1.2, size=(9, 93))
        self.X = rng.negative_binomial(0.4, 0.4 / (0.4 + means[self.y])).astype(np.float32)

    def __getitem__(self, idx):
        return (self.X[idx].astype("float32"), self.y[idx])

    def __len__(self):
        return len(self.X)


dataset = OttoDataset()

# In [None]:
print(dataset[0])

# In [None]:
import stoker
from stoker.writer import DatasetWriter

print(dir(stoker.fields))

# In [None]:
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption  # noqa: F401 - OrderOption: imported as in the notebook

writer = DatasetWriter(
    os.path.join(args.out, "my_easy_data.stoker"),
    {
        "x": NDArrayField(shape=(93,), dtype=np.dtype("float32")),
        "y": IntField(),
    },
    num_workers=min(16, os.cpu_count() or 1),
)

writer.from_indexed_dataset(dataset)

# In [None]:
# (the notebook imports Loader and OrderOption again here)
stoker_loader = Loader(
    os.path.join(args.out, "my_easy_data.stoker"),
    batch_size=1024,
    num_workers=1,
)

# In [None]:
import torch
from torch.utils.data import DataLoader

torch_loader = DataLoader(dataset, batch_size=1024, num_workers=1, pin_memory=torch.cuda.is_available())

# In [None]:
from torch import nn


class MySuperPooperNetwork(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(in_features, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, out_features))

    def forward(self, x):
        return self.model(x)


# In [None]:
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = MySuperPooperNetwork(93, 9).to(device)
optimizer = torch.optim.Adam(model.parameters(), 5e-4)
critetion = nn.CrossEntropyLoss()


def synchronize():
    if device.type == "cuda":
        torch.cuda.synchronize()


# In [None]:
import time

from tqdm import tqdm

# The notebook times every batch after the 11th (warm-up); a small table may have fewer batches.
WARMUP = 11 if len(stoker_loader) > 22 else 0
stoker_time = []
now = time.time()

for _ in range(args.epochs):
    for i, b in enumerate(tqdm(stoker_loader, disable=None)):
        x, y = b
        x = x.to(device)
        y = y.to(device).flatten()
        loss = critetion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        synchronize()
        if i >= WARMUP:
            stoker_time.append(time.time() - now)
        now = time.time()
print(f"stoker: batch x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, loss {loss.item():.4f}")

# In [None]:
torch_time = []

for _ in range(args.epochs):
    for i, b in enumerate(tqdm(torch_loader, disable=None)):
        x, y = b
        x = x.to(device)
        y = y.to(device).flatten()
        loss = critetion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        synchronize()
        if i >= WARMUP:
            torch_time.append(time.time() - now)
        now = time.time()
print(f"torch: batch x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, loss {loss.item():.4f}")

# In [None]:
# The notebook builds this table with pandas; printed by hand here.
rows = {}
for name, times in zip(["STOKER", "TORCH"], [stoker_time, torch_time]):
    rows[name] = [np.mean(times), np.median(times), np.quantile(times, 0.95)]
rows["UPLIFT (%)"] = [(s - t) / t * 100 for s, t in zip(rows["STOKER"], rows["TORCH"])]

print(f"{'':>12} {'Mean':>12} {'Median':>12} {'0.95-Quantile':>14}")
for name, (mean, median, q95) in rows.items():
    print(f"{name:>12} {mean:>12.6f} {median:>12.6f} {q95:>14.6f}")
print(f"final loss: {loss.item():.4f}")
