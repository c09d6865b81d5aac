"""Compatibility path: ``stoker.pipeline.graph`` is :mod:`stoker.loader._graph` (moved in issue 31); kept for code that imports it."""

from stoker.loader._graph import (
    AllocationQuery,
    Compiler,
    FieldPipeline,
    LoaderError,
    Operation,
    PipelineError,
    SampleDecoder,
    State,
    Step,
    build_pipeline,
    fusion_enabled,
    load_cached,
    offset_array,
)

__all__ = [
    "AllocationQuery",
    "Compiler",
    "FieldPipeline",
    "LoaderError",
    "Operation",
    "PipelineError",
    "SampleDecoder",
    "State",
    "Step",
    "build_pipeline",
    "fusion_enabled",
    "load_cached",
    "offset_array",
]
