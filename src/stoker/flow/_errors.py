"""The error a flow hands its consumer when a stage's function fails."""

from __future__ import annotations

from stoker.errors import StokerError


class StageError(StokerError):
    """A stage's function raised on one item.

    The original exception is ``exception`` (and ``__cause__``); the item is
    dropped. With ``max_failures=K`` the first ``K`` such errors are counted
    (:attr:`Pipeline.failures`) and the flow goes on; the next one stops it and
    is raised to the consumer.

    Attributes:
        stage: the stage's name (``source`` when the source's iterator raised).
        position: the item's position among the items that entered that stage (0-based).
        source_index: the position of the source item it came from, when it comes from
            exactly one (before any ``aggregate``); else ``None``.
        exception: what the function raised.
    """

    def __init__(self, stage: str, position: int, exception: BaseException, source_index: int | None = None) -> None:
        where = f"stage '{stage}', item {position}"
        if source_index is not None and source_index != position:
            where += f" (source item {source_index})"
        super().__init__(f"{where}: {type(exception).__name__}: {exception}")
        self.stage = stage
        self.position = position
        self.source_index = source_index
        self.exception = exception
        self.__cause__ = exception

    def __reduce__(self) -> tuple[type, tuple[str, int, BaseException, int | None]]:
        return (type(self), (self.stage, self.position, self.exception, self.source_index))
