"""A concurrent stage pipeline for Python functions, with SPDL's ``PipelineBuilder`` shape.

``from stoker.flow import PipelineBuilder``: a source, stages run on threads (plain
functions), an event loop (``async def``) or processes, ``aggregate`` /
``disaggregate``, a bounded sink. See ``docs/flow.md`` and this package's README
for the design. Nothing starts at import, and a pipeline holds no thread before
``start()``.
"""

from stoker.flow._bridges import write_dataset
from stoker.flow._builder import PipelineBuilder
from stoker.flow._errors import StageError
from stoker.flow._pipeline import Pipeline
from stoker.flow._stats import PipelineStats, StageStats

__all__ = ["Pipeline", "PipelineBuilder", "PipelineStats", "StageError", "StageStats", "write_dataset"]
