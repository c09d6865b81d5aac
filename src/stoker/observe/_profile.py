"""``stoker profile -- python train.py ...``: run a training script unchanged, then report on every Loader and flow it made.

The script runs in this process (``runpy``, as ``python`` would run it: ``__main__``,
``sys.argv``, ``sys.path[0]`` its folder), with every recorder kept
(:mod:`~stoker.observe._registry`) and a trace of everything recording. When it
ends, however it ends, the report of each Loader and flow goes to stderr and to
``report.txt``, the timeline to ``trace.json`` (streamed while the script runs,
with memory that does not grow with it) and a plot of each one's per-step
wait against its step time to ``steps.png`` (with matplotlib), all in the output
folder; the script's exit status is returned.
"""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path

from stoker.observe import _plot, _registry, _report, _trace

_PYTHONS = ("python", "python3")


def script_argv(command: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, args)`` of a command line ``[python] script.py args`` or ``[python] -m module args``.

    Raises:
        ValueError: no script or module to run.
    """
    argv = list(command)
    if argv and (Path(argv[0]).name.startswith(_PYTHONS) or argv[0] == sys.executable):
        argv = argv[1:]
    if not argv:
        raise ValueError("stoker profile needs a script to run: stoker profile -- python train.py [args]")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError("stoker profile -- python -m needs a module name")
        return "module", argv[1], argv[2:]
    return "path", argv[0], argv[1:]


def run(command: list[str], out: Path) -> int:
    """Run ``command``'s script in this process with accounting kept; write the report, trace and plot to ``out``.

    Returns:
        The script's exit status (0, ``sys.exit``'s code, 1 for an uncaught exception, 130 for Ctrl-C).
    """
    kind, target, args = script_argv(command)
    out.mkdir(parents=True, exist_ok=True)
    _registry.collect(True)
    session = _trace.start(None, out / "trace.json")  # streamed from now on: valid JSON however the script ends
    status = 0
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [target, *args]
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target).resolve().parent)
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        finish(session, out)
        _registry.collect(False)
    return status


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def finish(session: _trace.TraceSession, out: Path) -> None:
    """Fold every recorder into the trace, complete it, and write the report and the plot."""
    recorders = _registry.registered()
    try:
        for rec in recorders:
            rec.fold()
    finally:
        trace = _trace.stop(session)
    reports = [_report.render(_report.summarize(rec)) for rec in recorders]
    text = "\n\n".join(reports) if reports else "stoker profile: the script made no Loader or flow"
    (out / "report.txt").write_text(text + "\n")
    png = _plot.plot_steps(recorders, out / "steps.png")
    lines = [
        f"\n==== stoker profile: {len(recorders)} Loader(s) and flow(s) ====",
        text,
        f"trace: {trace}  (open in https://ui.perfetto.dev)",
    ]
    if png is not None:
        lines.append(f"plot: {png}")
    elif any(rec.count for rec in recorders):
        lines.append("plot: none: steps.png needs matplotlib (pip install matplotlib)")
    print("\n".join(lines), file=sys.stderr)
    sys.stderr.flush()
