"""Is training data-bound? Per-step accounting, reports and timelines shared by the Loader and flows.

The lowest layer that measures: it imports neither the Loader nor flows (they
import it). Each Loader and flow holds a recorder (``_recorder``): two rings of
per-batch timestamps written on the hot path without allocation, folded into
running totals off it. ``_report`` turns them into figures and a verdict,
``_trace`` into Chrome trace-event JSON streamed to a file by a writer thread
(``_events`` formats it; spans in ``torch.profiler`` too),
``_plot`` into a PNG, and ``_registry`` keeps every recorder for ``stoker profile``.

Public here: the hook lower layers call to put a span on the timeline
(:func:`record_span`, :func:`span`) and the switch (:func:`accounting_enabled`).
See ``docs/observability.md``.
"""

from stoker.observe._registry import enabled as accounting_enabled
from stoker.observe._trace import record_span, span

__all__ = ["accounting_enabled", "record_span", "span"]
