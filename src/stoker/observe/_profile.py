"""``stoker profile -- python train.py ...``: run a training script unchanged, then report on every Loader and flow it made.

The script runs in this process (``runpy``, as ``python`` would run it: ``__main__``,
``sys.argv``, ``sys.path[0]`` its folder), with every recorder kept
(:mod:`~stoker.observe._registry`) and a trace of everything recording. When it
ends, however it ends, the report of each Loader and flow goes to stderr and to
``report.txt``, the timeline to ``trace.json`` (streamed while the script runs,
with memory that does not grow with it) and a plot of each one's per-step
wait against its step time to ``steps.png`` (with matplotlib), all in the output
folder; the script's exit status is returned.

The command is checked before anything runs (:func:`script_argv`): ``[python] script.py
[args]`` or ``[python] -m module [args]``, where the script is a ``.py`` or ``.pyc`` file, a
file of Python source, or a folder or zip archive with a ``__main__.py``. Interpreter
options (``-u``, ``-X``, ``-W``, ``-c`` ...) are refused, naming the option: the script runs
in this process, whose interpreter has started already; give them to it instead
(``python -u -m stoker profile -- python train.py``).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
import runpy
import sys
import traceback
import zipfile
from pathlib import Path

from stoker.observe import _plot, _registry, _report, _trace

#: the name of a Python interpreter: python, python3, python3.12
_PYTHON = re.compile(r"python[0-9.]*")
_USAGE = "python train.py [args] or python -m module [args]"


def script_argv(command: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, args)`` of a command line ``[python] script.py args`` or ``[python] -m module args``.

    ``kind`` is ``"module"`` or ``"path"``; a path is checked by :func:`check_script`.

    Raises:
        ValueError: no script or module to run; an interpreter option other than ``-m``; a
            script that does not exist or is not Python.
    """
    argv = list(command)
    if argv and (_PYTHON.fullmatch(Path(argv[0]).name) or argv[0] == sys.executable):
        argv = argv[1:]
    if not argv:
        raise ValueError(f"stoker profile needs a script to run: stoker profile -- {_USAGE}")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError("stoker profile -- python -m needs a module name")
        check_module(argv[1])
        return "module", argv[1], argv[2:]
    if argv[0].startswith("-"):
        option = " ".join(argv[:2]) if argv[0] in ("-X", "-W") else argv[0]  # with its value
        hint = (
            "put the code in a file and give that: python that.py"
            if argv[0] == "-" or argv[0].startswith("-c")
            else f"give it to the Python that runs stoker: python {option} -m stoker profile -- python train.py"
        )
        raise ValueError(f"the python option {option} is not supported (only -m is): {hint}")
    check_script(argv[0])
    return "path", argv[0], argv[1:]


def check_module(name: str) -> None:
    """Refuse, before it runs, a module ``python -m name`` would not find: its top-level package or module, looked
    for where ``python -m`` looks (the current folder first), without importing anything.

    Raises:
        ValueError: ``name`` is not a dotted name, or no module or package is named its first part.
    """
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"{name!r} is not a module name; give one: {_USAGE}")
    top = name.split(".")[0]
    saved = sys.path[0] if sys.path else None
    try:
        _cwd_first()
        found = importlib.util.find_spec(top) is not None  # (a top-level name: nothing is imported to find it)
    finally:
        if saved is not None:
            sys.path[0] = saved
    if not found:
        raise ValueError(f"no module named {top} (looked in the current folder, then sys.path); give a module: {_USAGE}")


def _cwd_first() -> None:
    """``sys.path[0]`` as ``python -m`` sets it: the current folder (a console script's is its own folder)."""
    if sys.path:
        sys.path[0] = os.getcwd()
    else:
        sys.path.append(os.getcwd())


def check_script(target: str) -> None:
    """Refuse, before it runs, a ``target`` that ``python target`` would not run as Python.

    Runs: a ``.py`` or ``.pyw`` file (its syntax errors are the script's, reported when it
    runs), any other file of Python source (text that compiles: ``python train`` works too),
    a ``.pyc`` file, or a folder or zip archive with a ``__main__.py``.

    Raises:
        ValueError: ``target`` does not exist, cannot be read, or is not Python (a binary
            file such as ``/usr/bin/env``, a shell script).
    """
    path = Path(target)
    if not path.exists():
        raise ValueError(f"{target} does not exist; give a Python script: {_USAGE}")
    try:
        if path.is_dir() or zipfile.is_zipfile(path):  # runpy runs the __main__ module inside, as python does
            importer = pkgutil.get_importer(str(path))
            if importer is None or importer.find_spec("__main__") is None:
                raise ValueError(f"{target} has no __main__.py to run; give a Python script: {_USAGE}")
            return
        if path.suffix == ".pyc":
            return  # runpy runs it as python does
        with path.open("rb") as file:
            head = file.read(8192)
        source = None if path.suffix in (".py", ".pyw") else path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{target}: cannot read it: {exc.strerror or exc}") from None
    if b"\0" in head:
        raise ValueError(f"{target} is a binary file, not a Python script; give one: {_USAGE}")
    if source is not None:
        try:
            compile(source, target, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:  # ValueError: null bytes, or not text in its encoding
            raise ValueError(f"{target} is not a Python script (not a .py file, nor Python source: {exc}); give one: {_USAGE}") from None


def run(command: list[str], out: Path) -> int:
    """Run ``command``'s script in this process with accounting kept; write the report, trace and plot to ``out``.

    Returns:
        The script's exit status (0, ``sys.exit``'s code, 1 for an uncaught exception, 130 for Ctrl-C).

    Raises:
        ValueError: before the script runs: the command is not one :func:`script_argv` runs, or
            ``out`` is not a folder and cannot be made one.
    """
    kind, target, args = script_argv(command)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{out} is not a folder") from None
    except OSError as exc:
        raise ValueError(f"{out}: cannot make the folder: {exc.strerror or exc}") from None
    _registry.collect(True)
    session = _trace.start(None, out / "trace.json")  # streamed from now on: valid JSON however the script ends
    status = 0
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [target, *args]
    try:
        if kind == "module":
            _cwd_first()
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
