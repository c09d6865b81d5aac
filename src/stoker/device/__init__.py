"""Moving batches to a device: :func:`to_device` and :func:`prefetch`, for any source of batches.

``to_device(batch, device)`` walks nested dicts, lists, tuples, named tuples and
dataclasses and moves every tensor, small ones in a single copy;
``prefetch(iterable, device, depth=2)`` copies the next ``depth`` batches on a
CUDA stream of its own while the loop uses the current one;
``record_stream(batch, stream)`` declares a stream other than the current
one (a side stream) that uses a batch, so that its memory is not reused
before that stream's work is done. They sit on top of
torch and below the Loader: they work for a stoker Loader, a DataLoader or a
generator alike.

::

    _tree.py       tree_map: walk and rebuild nested containers
    _pack.py       pack / unpack: small tensors in one aligned byte buffer
    _book.py       SlotBook: per slot, the copy in flight, when host memory may be written again,
                   the marks the next copy waits for (no torch: tested against a reference model)
    _stream.py     StreamTransfer: the one transfer to CUDA (its own stream, one event per slot,
                   marks, record_stream), used by the Loader's ToDevice and by prefetch;
                   record_stream: a side stream declared for a batch
    _transfer.py   to_device: the copies, page-locked staging, buffers kept until copied
    _prefetch.py   prefetch: look-ahead (a StreamTransfer on CUDA), its state counting only
                   the batches the loop received

``import stoker.device`` imports no torch; the functions import it when called.
See docs/device.md for the stream semantics.
"""

from stoker.device._prefetch import Prefetcher, PrefetchIterator, prefetch
from stoker.device._stream import record_stream
from stoker.device._transfer import COALESCE_MAX_BYTES, to_device

__all__ = ["COALESCE_MAX_BYTES", "PrefetchIterator", "Prefetcher", "prefetch", "record_stream", "to_device"]
