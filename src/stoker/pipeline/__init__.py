"""Pipelines: operations, their states and memory, and their compilation."""

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State

__all__ = ["AllocationQuery", "Compiler", "Operation", "State"]
