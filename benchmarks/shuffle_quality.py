"""Shuffle quality of QUASI_RANDOM against RANDOM and SEQUENTIAL (stoker.loader.order.shuffle_quality).

    .venv/bin/python benchmarks/shuffle_quality.py [--samples 1000000] [--shards 64] [--batch 256]

Prints a markdown table: for each order (and chunk size, window), the normalised neighbour distance in a single
file and over shards, and the shards a batch reads. Pure computation on the orders: no file is read.
"""

from __future__ import annotations

import argparse

import numpy as np

from stoker.loader.order import OrderOption, epoch_order, shuffle_quality


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    n, b = args.samples, args.batch
    indices = np.arange(n, dtype=np.int64)
    starts = np.linspace(0, n, args.shards + 1).astype(np.int64)
    rows = [("SEQUENTIAL", "", "", OrderOption.SEQUENTIAL, b, 1), ("RANDOM", "", "", OrderOption.RANDOM, b, 1)]
    for chunk in (b, 8 * b, 64 * b):
        for window in (1, 4, 16, 64):
            rows.append(("QUASI_RANDOM", str(chunk), str(window), OrderOption.QUASI_RANDOM, chunk, window))
    print(f"{n} samples, {args.shards} shards of {n // args.shards}, batches of {b}\n")
    print("| order | chunk_size | window_chunks | window [samples] | neighbour distance, one file | neighbour distance, shards "
          "| shards per batch | shard mixing |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, chunk, window, order, chunk_size, window_chunks in rows:
        one = shuffle_quality(epoch_order(order, indices, 0, 0, chunk_size, window_chunks), b)
        sharded = shuffle_quality(epoch_order(order, indices, 0, 0, chunk_size, window_chunks, starts), b, starts)
        span = str(chunk_size * window_chunks) if chunk else ""
        print(f"| {name} | {chunk} | {window} | {span} | {one['neighbour_distance']:.3f} | {sharded['neighbour_distance']:.3f} "
              f"| {sharded['shards_per_batch']:.2f} | {sharded['shard_mixing']:.3f} |")  # fmt: skip
    # windows over groups of shards (window_shards): the knob that mixes shards, at the cost of reading k shards at once
    print("\nQUASI_RANDOM over the shards with window_shards (chunk_size 2048, window_chunks 16):\n")
    print("| window_shards | shards read together | neighbour distance, shards | shards per batch | shard mixing |")
    print("|---:|---:|---:|---:|---:|")
    for k in (1, 2, 4, 8, 16, 64):
        q = shuffle_quality(epoch_order(OrderOption.QUASI_RANDOM, indices, 0, 0, 8 * b, 16, starts, window_shards=k), b, starts)
        print(f"| {k} | {k} | {q['neighbour_distance']:.3f} | {q['shards_per_batch']:.2f} | {q['shard_mixing']:.3f} |")


if __name__ == "__main__":
    main()
