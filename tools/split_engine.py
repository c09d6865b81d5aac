"""Issue 31's split of ``stoker/loader/_engine.py``, replayable: planning and code generation, producers, the consumer loop.

Run from a repository root, after ``tools/restructure.py``, on a clean tree::

    python tools/split_engine.py

It moves top-level definitions, by name, out of ``_engine.py`` into :data:`SPLITS`' modules (each with the imports it
needs, found by ``ruff``), leaves the rest (the consumer loop, ``CompiledEpoch``) in ``_engine.py``, and rewrites the
uses of a moved name through the module (``_engine.plan`` -> ``_planner.plan``) in ``src`` and ``tests``. A name that
is not listed (one added since) stays in ``_engine.py``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
ENGINE = ROOT / "src" / "stoker" / "loader" / "_engine.py"
BIN = Path(sys.executable).parent

SPLITS: dict[str, tuple[str, list[str]]] = {
    "_planner": (
        '''"""Planning and code generation: how a Loader's epochs make their batches' heads.

:func:`plan` groups the fields whose heads share one compiled function, and either generates and compiles one
producer loop for all of them (:func:`_source`: Python source from the plan, compiled by Numba once per fingerprint,
see :mod:`stoker.pipeline.cache`) or says why the epochs use Python producers instead (:func:`python_plan`).
The producers (:mod:`stoker.loader._producers`) run what is planned here; the consumer loop
(:mod:`stoker.loader._engine`) hands the batches over.
"""''',
        [
            "_SHUFFLE_PIECE",
            "_generated",
            "_LOOPS",
            "_LOOPS_LOCK",
            "Group",
            "LoopCalls",
            "Plan",
            "_enabled",
            "_is_dispatcher",
            "_numpy_type",
            "python_plan",
            "_signature",
            "plan",
            "_source",
            "_compile",
        ],
    ),
    "_producers": (
        '''"""Producers: the jobs that make an epoch's batches' heads into slots of the ring.

:class:`_Batches` holds one epoch's batches as producers see them (order, positions, seeds, the arguments of the
compiled loop of :mod:`stoker.loader._planner`) and makes a batch with Python calls where there is no compiled loop
(:meth:`_Batches.make_python`); :class:`_Job` is one producer thread's share of the epoch. They signal each batch
through the slot ring (:mod:`stoker.loader._ring`); the consumer loop (:mod:`stoker.loader._engine`) starts them.
"""''',
        ["_NO_ORDER", "producers_beside_loop", "LIST_FROM", "_arrays_arg", "_seed_bases", "_Batches", "_Job"],
    ),
}


ENGINE_WHERE = """Where each part lives: planning and code generation in :mod:`stoker.loader._planner` (:func:`plan`,
:func:`_source`), the producers' jobs in :mod:`stoker.loader._producers` (:class:`_Batches`, :class:`_Job`), the
consumer loop here (:class:`CompiledEpoch`), the slot ring in :mod:`stoker.loader._ring`.
"""


def names_of(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        out: list[str] = []
        for t in node.targets:
            out += [t.id] if isinstance(t, ast.Name) else [e.id for e in getattr(t, "elts", []) if isinstance(e, ast.Name)]
        return out
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def is_header(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return True  # the docstring
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def main() -> None:
    text = ENGINE.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    body = tree.body
    first = next(i for i, n in enumerate(body) if not is_header(n))
    doc = ast.get_docstring(tree, clean=False)
    doc_end = body[0].end_lineno if doc is not None else 0
    header_start = doc_end  # 0-based line index after the docstring
    header = "".join(lines[header_start : start_line(body[first], lines) - 1])

    owner = {name: mod for mod, (_, names) in SPLITS.items() for name in names}
    parts: dict[str, list[str]] = {mod: [] for mod in SPLITS} | {"_engine": []}
    defined: dict[str, str] = {}
    for node in body[first:]:
        names = names_of(node)
        mod = next((owner[n] for n in names if n in owner), "_engine")
        parts[mod].append("".join(lines[start_line(node, lines) - 1 : node.end_lineno]).rstrip() + "\n")
        for n in names:
            defined[n] = mod

    order = [*SPLITS, "_engine"]
    files: list[Path] = []
    for k, mod in enumerate(order):
        below = [m for m in order[:k]]
        imports = "".join(
            f"from stoker.loader.{m} import {', '.join(sorted(n for n, owner_ in defined.items() if owner_ == m))}\n" for m in below
        )
        docstring = '"""' + doc + '"""' if mod == "_engine" and doc is not None else SPLITS[mod][0] if mod in SPLITS else ""
        if mod == "_engine":
            docstring = docstring[:-3].rstrip() + "\n\n" + ENGINE_WHERE + '"""'
        head, sep, typing_block = header.partition("\nif TYPE_CHECKING:")
        out = docstring + "\n" + head.rstrip() + "\n" + imports + sep + typing_block.rstrip() + "\n\n\n" + "\n\n".join(parts[mod])
        path = ENGINE.with_name(f"{mod}.py")
        path.write_text(out)
        files.append(path)

    # uses of a moved name through the module: _engine.plan -> _planner.plan (src and tests)
    moved = {n: m for n, m in defined.items() if m != "_engine"}
    for path in [*ROOT.glob("src/stoker/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        if path in files:
            continue
        src = path.read_text()
        new = re.sub(r"\b_engine\.(\w+)\b", lambda m: f"{moved[m[1]]}.{m[1]}" if m[1] in moved else m[0], src)
        new = re.sub(
            r"^(\s*)from stoker\.loader\._engine import ([^\n(]+)$",
            lambda m: split_import(m[1], m[2], moved),
            new,
            flags=re.M,
        )
        if new != src:
            used = sorted({moved[n] for n in re.findall(r"\b(?:_planner|_producers)\.(\w+)", new) if n in moved})
            for mod in used:
                if not re.search(rf"^\s*from stoker\.loader import [^\n]*\b{mod}\b", new, flags=re.M) and f"import {mod}" not in new:
                    new = re.sub(
                        r"^(from stoker\.loader import [^\n]+)$", rf"\1\nfrom stoker.loader import {mod}", new, count=1, flags=re.M
                    )
                    if f"from stoker.loader import {mod}" not in new:
                        new = new.replace("\nfrom stoker", f"\nfrom stoker.loader import {mod}\nfrom stoker", 1)
            path.write_text(new)
            files.append(path)
    names = [str(p) for p in files]
    subprocess.run([BIN / "ruff", "check", "--fix", "--unsafe-fixes", "--select", "F401,I", *names[:3]], cwd=ROOT, check=False)
    subprocess.run([BIN / "ruff", "check", "--fix", "--select", "I", *names], cwd=ROOT, check=False)
    subprocess.run([BIN / "ruff", "format", *names], cwd=ROOT, check=False)
    subprocess.run(["git", "add", "-A", "src", "tests"], cwd=ROOT, check=True)
    print("split", ENGINE.relative_to(ROOT), "into", ", ".join(f"{m}.py" for m in order))


def start_line(node: ast.stmt, lines: list[str]) -> int:
    """The 1-based first line of ``node``, its decorators and the comment lines right above it."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    while start > 1 and lines[start - 2].lstrip().startswith("#"):
        start -= 1
    return start


def split_import(indent: str, names: str, moved: dict[str, str]) -> str:
    groups: dict[str, list[str]] = {}
    for item in (s.strip() for s in names.split("#")[0].split(",")):
        if item:
            groups.setdefault(moved.get(item.split(" as ")[0].strip(), "_engine"), []).append(item)
    return "\n".join(f"{indent}from stoker.loader.{m} import {', '.join(v)}" for m, v in groups.items())


if __name__ == "__main__":
    main()
