"""Benchmarks behind ``stoker bench``: stoker against ``torch.utils.data.DataLoader``.

::

    bench/
      data.py       the Otto-shaped table, the notebook's OttoDataset, the stoker file, fingerprints
      baselines.py  DataLoader (per-sample and batched __getitems__) and the two limits (numpy take, compiled gather)
      checks.py     the checks every system must pass before a time counts (shapes, dtypes, values)
      loading.py    loader-only comparison: each system built, checked, then timed in alternating rounds
      training.py   the notebook's MLP trained with each loader (stoker, both DataLoaders) in alternating rounds
      rounds.py     the rounds' order, and what they say: per-round ratios, their spread, a verdict
      load.py       other work's load beside the benchmark's own: was the machine busy?
      machine.py    machine facts (a thread hand-off's cost)
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
