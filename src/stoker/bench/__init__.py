"""Benchmarks behind ``stoker bench``: stoker against ``torch.utils.data.DataLoader``.

::

    bench/
      data.py       the Otto-shaped table, the notebook's OttoDataset, the stoker file, fingerprints
      baselines.py  DataLoader (per-sample and batched __getitems__) and the two limits (numpy take, compiled gather)
      loading.py    loader-only comparison: timing and the checks every system must pass (values included)
      training.py   the notebook's MLP trained with each loader (stoker, both DataLoaders), per-batch times
      pixels.py     pixel checks within a tolerance, for benchmarks/images.py
      startup.py    time to first batch in fresh processes (cold and warm Numba cache)
      report.py     markdown, JSON and the bar chart (when matplotlib is installed)
      otto.py       BenchConfig and run_otto_bench, which ties them together

Lifecycle: ``BenchConfig`` -> ``run_otto_bench`` (raises ``BenchCheckError``
before any number is returned if a system is wrong) -> ``write_outputs``.
Nothing heavy is imported here: torch, numba and matplotlib load on use.
"""

from __future__ import annotations

__all__: list[str] = []
