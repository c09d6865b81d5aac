"""Small versioned datasets for the folder-transaction tests, and a writer run as a child process that waits at each step.

``python -m tests.format._folder_data FOLDER VERSION N PER`` rewrites FOLDER
with version VERSION (N samples, PER per shard) and stops before each step:
reading a sample, renaming a file into place, deleting a file. At each stop it
prints one line naming the step and waits for a line on stdin, so that the
test can signal it at an exact step, without depending on timing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stoker.fields import BytesField, IntField, NDArrayField

FIELDS = {"v": IntField(), "b": BytesField(), "x": NDArrayField((3,), np.dtype("<i4"))}


def sample(version: int, i: int) -> tuple[int, bytes, np.ndarray]:
    """Sample ``i`` of version ``version``: every value says which version and which sample it is."""
    return version * 1000 + i, bytes([version % 256]) * (i % 7), np.array([version, i, -i], dtype=np.int32)


class Data:
    """Version ``version`` of a dataset of ``n`` samples; ``fail_at`` raises at that sample, ``hook`` runs before each."""

    def __init__(self, version: int, n: int, fail_at: int | None = None, hook: Callable[[str], None] | None = None) -> None:
        self.version, self.n, self.fail_at, self.hook = version, n, fail_at, hook

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, bytes, np.ndarray]:
        if self.hook is not None:
            self.hook(f"sample {i}")
        if i == self.fail_at:
            raise ValueError(f"sample {i} cannot be read")
        return sample(self.version, i)


def as_plain(values: tuple[Any, ...]) -> tuple[int, bytes, tuple[int, ...]]:
    v, b, x = values
    return int(v), bytes(b), tuple(int(e) for e in np.asarray(x))


def expected(version: int, n: int) -> list[tuple[int, bytes, tuple[int, ...]]]:
    return [as_plain(sample(version, i)) for i in range(n)]


def _stop(what: str) -> None:
    sys.stdout.write(what + "\n")
    sys.stdout.flush()
    sys.stdin.readline()


def main(folder: str, version: int, n: int, per: int) -> None:
    from stoker.dataset import ShardedWriter

    real_replace, real_unlink = os.replace, os.unlink

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        _stop(f"replace {Path(dst).name}")
        real_replace(src, dst, **kwargs)

    def unlink(path: Any, **kwargs: Any) -> None:
        _stop(f"unlink {Path(path).name}")
        real_unlink(path, **kwargs)

    os.replace, os.unlink = replace, unlink  # type: ignore[assignment]
    ShardedWriter(folder, FIELDS, samples_per_shard=per, num_workers=1, progress=False).from_indexed_dataset(Data(version, n, hook=_stop))
    _stop("done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
