"""WebDataset tar shards as a writer source (:meth:`~stoker.format.DatasetWriter.from_webdataset`).

As in FFCV, a *pipeline* turns a ``webdataset.WebDataset`` of one shard into an
iterable of samples; the samples of every shard are counted first (one pass
through the pipeline, in threads), which places each shard in the file, then
each shard is encoded by one worker, in chunks. The simpler form, a mapping of
field names to WebDataset keys (``{"image": "jpg;png", "label": "cls"}``),
builds the pipeline ``dataset.decode().to_tuple(...)``: WebDataset's basic
decoders turn ``cls``, ``json``, ``txt``, ``npy``... into Python values and
leave images as their file's bytes, which :class:`~stoker.fields.RGBImageField`
stores as they are when they are JPEGs it can keep.

``webdataset`` is an optional dependency (``pip install 'stoker[webdataset]'``),
imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import itertools
import os
import traceback
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stoker._threads import block_interrupts
from stoker.errors import SampleError
from stoker.fields import Field
from stoker.format._workers import Chunk

Pipeline = Callable[[Any], Iterable[Any]]


def import_webdataset() -> Any:
    """The ``webdataset`` module, or an ``ImportError`` that says how to install it."""
    try:
        import webdataset
    except ImportError as exc:
        raise ImportError(
            "DatasetWriter.from_webdataset needs the webdataset package: pip install 'stoker[webdataset]' (or pip install webdataset)"
        ) from exc
    return webdataset


def by_keys(keys: Sequence[str], dataset: Any) -> Iterable[Any]:
    """The pipeline of the ``keys`` form: WebDataset's basic decoders, then one value per key (``"jpg;png"``: the first present)."""
    return dataset.decode().to_tuple(*keys)


def resolve(
    fields: Mapping[str, Field], shards: Any, pipeline: Pipeline | None, keys: Mapping[str, str] | None, chunksize: int
) -> tuple[list[str], Pipeline]:
    """Check a ``from_webdataset`` call's arguments; returns the tar paths and the pipeline (made from ``keys`` if none).

    Raises:
        ValueError: ``chunksize`` below 1, or both ``pipeline`` and ``keys``.
        ImportError: webdataset is not installed (with what to install).
    """
    if chunksize < 1:
        raise ValueError(f"chunksize must be >= 1; got {chunksize}")
    if pipeline is not None and keys is not None:
        raise ValueError("give either pipeline (a function of a WebDataset) or keys (field name -> WebDataset key), not both")
    import_webdataset()
    paths = [os.fspath(shards)] if isinstance(shards, (str, os.PathLike)) else [os.fspath(s) for s in shards]
    if pipeline is None:
        pipeline = keys_pipeline(fields, keys if keys is not None else {name: name for name in fields})
    return paths, pipeline


def keys_pipeline(fields: Mapping[str, Field], keys: Mapping[str, str]) -> Pipeline:
    """The pipeline reading field ``name`` from the WebDataset key ``keys[name]``, in field order.

    Raises:
        ValueError: ``keys`` does not name exactly the fields.
    """
    missing, extra = [n for n in fields if n not in keys], [k for k in keys if k not in fields]
    if missing or extra:
        raise ValueError(f"keys must map every field name to a WebDataset key, {list(fields)}; missing {missing}, unexpected {extra}")
    return functools.partial(by_keys, tuple(keys[name] for name in fields))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without webdataset's warnings about the shard files it leaves to the garbage collector to close."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        yield


def shard_samples(shard: str | os.PathLike[str], pipeline: Pipeline) -> Iterable[Any]:
    """The samples of one shard: ``pipeline(WebDataset(shard))``, the shard read once, in order, on this node."""
    wds = import_webdataset()
    options: dict[str, Any] = {"shardshuffle": False, "nodesplitter": None, "workersplitter": None}
    if "empty_check" in inspect.signature(wds.WebDataset).parameters:  # webdataset >= 0.2.90: an empty shard is no error here
        options["empty_check"] = False
    return pipeline(wds.WebDataset(os.fspath(shard), **options))


def _release(exc: BaseException) -> None:
    """Close the shard's file now: the failed pipeline's generators (holding it open) are freed with the frames
    of ``exc``'s traceback, here, under :func:`_quiet`, rather than by a later garbage collection."""
    traceback.clear_frames(exc.__traceback__)
    gc.collect()


def count_samples(shards: Sequence[str | os.PathLike[str]], pipeline: Pipeline, threads: int) -> list[int]:
    """How many samples ``pipeline`` gives for each shard (one pass through each, ``threads`` at a time)."""

    def count(shard: str | os.PathLike[str]) -> int:
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"the WebDataset shard {os.fspath(shard)} does not exist (or is not a file)")
        samples, total = iter(shard_samples(shard, pipeline)), 0
        try:
            for _ in samples:
                total += 1
        except Exception as exc:  # a corrupt tar, a key missing from a sample, a decoder that failed
            problem = f"{type(exc).__name__}: {exc}"
            error = ValueError(f"the WebDataset shard {os.fspath(shard)}, its sample {total} (counting the samples): {problem}")
            _release(exc)
            del samples
            raise error from exc
        close = getattr(samples, "close", None)
        if close is not None:
            close()
        return total

    with _quiet(), ThreadPoolExecutor(max(1, threads), thread_name_prefix="stoker-wds-count", initializer=block_interrupts) as pool:
        return list(pool.map(count, shards))


def first_samples(shards: Sequence[str | os.PathLike[str]], pipeline: Pipeline, count: int) -> list[Any]:
    """The first ``count`` samples of the shards, read in order (fewer if they hold fewer)."""
    out: list[Any] = []
    with _quiet():
        for shard in shards:
            if len(out) >= count:
                break
            samples = iter(shard_samples(shard, pipeline))
            out.extend(itertools.islice(samples, count - len(out)))
            close = getattr(samples, "close", None)
            if close is not None:
                close()
            del samples
        gc.collect()  # a shard not read to its end: its file is closed here, quietly
    return out


def tasks_between(shards: Sequence[str | os.PathLike[str]], counts: Sequence[int], start: int, stop: int) -> list[tuple[int, Any]]:
    """The :class:`ShardSource` tasks that encode samples ``[start, stop)`` of the shards taken one after the other.

    Returns:
        ``(position in the output, task)`` pairs; a task is ``(shard, index of
        its first sample, its sample count, first, stop)``: samples
        ``[first, stop)`` of that shard.
    """
    tasks: list[tuple[int, Any]] = []
    first = 0
    for shard, count in zip(shards, counts):
        a, b = max(start, first), min(stop, first + count)
        if a < b:
            tasks.append((a - start, (os.fspath(shard), first, count, a - first, b - first)))
        first += count
    return tasks


class ShardSource:
    """What writer workers encode for ``from_webdataset``: a task is ``(shard, first index, sample count)``.

    A task may name a part of the shard, ``(shard, first index, sample count,
    begin, end)``: its samples ``[begin, end)`` (those before are read and skipped).
    """

    def __init__(self, pipeline: Pipeline, fields: dict[str, Field], chunksize: int) -> None:
        self.pipeline = pipeline
        self.fields = fields
        self.chunksize = chunksize

    def encode(self, task: tuple[Any, ...]) -> Iterator[Chunk]:
        """The shard's samples, ``chunksize`` at a time; sample ``i`` of the shard is sample ``first + i`` of the file."""
        from stoker.format.writer import encode_samples

        shard, first, count = task[:3]
        begin, end = task[3:5] if len(task) > 3 else (0, count)
        with _quiet():
            samples = iter(shard_samples(shard, self.pipeline))
            numbered = self._numbered(samples, shard, first)
            skipped = sum(1 for _ in itertools.islice(numbered, begin))
            if skipped < begin:
                raise SampleError(first + skipped, None, self._changed(shard, skipped, count))
            done = begin
            while done < end:
                size = min(self.chunksize, end - done)
                batch = list(itertools.islice(numbered, size))
                if len(batch) < size:
                    raise SampleError(first + done + len(batch), None, self._changed(shard, done + len(batch), count))
                yield encode_samples(batch, size, self.fields)
                done += size
            if end == count and next(numbered, None) is not None:
                raise SampleError(first + count, None, self._changed(shard, count + 1, count))
            if end < count:  # the shard was not read to its end: close its file here, quietly, not in a later collection
                numbered.close()
                close = getattr(samples, "close", None)
                if close is not None:
                    close()
                del numbered, samples
                gc.collect()

    @staticmethod
    def _numbered(samples: Iterator[Any], shard: str, start: int) -> Generator[tuple[int, Any], None, None]:
        index = start
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                return
            except Exception as exc:  # a corrupt tar, a key missing from a sample, a decoder that failed
                raise SampleError(index, None, f"reading the WebDataset shard {shard}: {type(exc).__name__}: {exc}") from exc
            yield index, sample
            index += 1

    @staticmethod
    def _changed(shard: str, got: int, count: int) -> str:
        more = f"at least {got}" if got > count else str(got)
        return (
            f"the pipeline gave {more} samples for the WebDataset shard {shard}, {count} when they were counted: "
            "it must give the same samples each time it reads a shard (no random filtering or augmentation)"
        )
