"""The :class:`Operation` base class: declare state and memory, then generate code."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.fields.base import Field
    from stoker.format.reader import Reader
    from stoker.pipeline.allocation_query import AllocationQuery
    from stoker.pipeline.state import State


class Operation(ABC):
    """One step of a field's pipeline (a decoder or a transform).

    Subclasses implement two methods:

    * :meth:`declare_state_and_memory` says how the operation changes the
      batch's :class:`~stoker.pipeline.state.State` and which memory it needs
      (an :class:`~stoker.pipeline.allocation_query.AllocationQuery`, or
      ``None`` to work in place).
    * :meth:`generate_code` returns the function that runs once per batch.
      In jit mode it is compiled with Numba (``nogil``); give it the attribute
      ``is_parallel = True`` and loop with
      :meth:`stoker.pipeline.compiler.Compiler.get_iterable` to spread samples
      over the loader's threads.

    The generated function is called as ``fn(batch, dst)``, or
    ``fn(batch, dst, indices)`` if it takes three arguments (the samples'
    indices in the dataset file), or ``fn(batch, dst, indices, seeds)`` if it
    takes four: ``seeds`` is a ``uint64`` array, one random seed per sample,
    derived from (loader seed, epoch, sample index, operation), so random
    augmentations give the same result whatever the number of threads.
    Decoders (the first operation) are called as
    ``fn(indices, dst, arrays, storage, seeds)``.
    """

    #: ``True`` if the generated code keeps no state between calls (no per-thread
    #: buffers or handles, nothing written but ``dst``), so that the loader may run
    #: it on two batches at once. Off by default for operations you write.
    reentrant: bool = False

    #: ``True`` if the function :meth:`generate_code` returns only hands the batch to compiled
    #: functions (a few calls a batch, no loop over samples in Python), so that it may run as Python
    #: calling them: the loader does so while the pipeline's fused code is being compiled (the first
    #: epoch in a new environment). Off by default for operations you write.
    wraps_kernels: bool = False

    #: ``True`` if the generated function only returns a view of its input (``batch``): no memory of its own (it
    #: ignores ``dst``), no indices, no seeds, no state between calls, and the view depends on the batch's shape, dtype
    #: and memory alone, never on its values (``ToTensor``, ``Squeeze``, ``View``). A loader runs a tail of such steps
    #: once per batch slot and hands the same tensor out again for every full batch made into that slot, while nothing
    #: outside the loader holds it (see ``docs/loader.md``, "Outputs made once per slot"). Off by default for operations
    #: you write.
    view_only: bool = False

    #: set by the loader before ``declare_state_and_memory`` (decoders use them)
    field: Field | None = None
    field_name: str | None = None
    reader: Reader | None = None
    metadata: Any = None

    def accept_field(self, field: Field) -> None:
        """Receive the field this operation decodes (FFCV's hook)."""
        self.field = field

    def accept_globals(self, metadata: Any, memory_read: Any = None) -> None:
        """Receive the dataset's metadata table (FFCV's hook)."""
        self.metadata = metadata

    @abstractmethod
    def generate_code(self) -> Callable[..., Any]:
        """Return the function that processes one batch."""

    def generate_sample_code(self) -> Callable[..., Any] | SampleDecoder | None:
        """The per-sample form of :meth:`generate_code`, so that consecutive steps fuse into one pass; ``None``: none.

        Consecutive compiled steps that all have one (the decoder first, if it has
        one: see :class:`SampleDecoder`) are compiled as one loop over the batch's
        samples, each sample going through every step while it is in the cache.
        The function is called as ``fn(sample, dst, index, seed)`` with the
        previous step's sample, this step's memory for it (the sample itself when
        the step asks for no memory), the sample's index in the dataset and its
        seed; it returns this step's output sample. It must compute exactly what
        :meth:`generate_code`'s function computes for that sample (the built-in
        operations' batch kernels call their per-sample kernel): fused and unfused
        pipelines give the same batches.
        """
        return None

    @abstractmethod
    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        """Return the state after this operation and the memory it needs."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SampleDecoder:
    """What a decoder offers for fusion (:meth:`Operation.generate_sample_code` of a decoder returns one).

    Attributes:
        sample: ``fn(i, j, seed, dst, arrays, storage)``: decode sample ``j`` of the
            dataset into ``dst[i]`` (and, for a failure replaced by zeros, write them
            there at once, before the steps after it).
        begin: ``fn(indices, dst, arrays)`` before the batch's samples, or ``None``.
        end: ``fn(indices, dst, arrays)`` after them (failures counted or raised), or ``None``.
    """

    def __init__(self, sample: Callable[..., Any], begin: Callable[..., Any] | None = None, end: Callable[..., Any] | None = None) -> None:
        self.sample, self.begin, self.end = sample, begin, end
