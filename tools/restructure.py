"""Issue 31's moves, replayable: one room per concept, done mechanically on a clean tree.

Run from a repository root, on a clean working tree, with the venv's Python::

    python tools/restructure.py          # moves (git mv), rewrites imports, writes the compatibility modules
    python tools/restructure.py --dry    # prints the moves it would make

What it does, in order:

1. ``git mv`` every module of :data:`MOVES` (a glob in the old folder catches files another branch added
   since, e.g. every ``format/_remote*.py``);
2. rewrites every import and dotted path of a moved module in ``src``, ``tests``, ``benchmarks`` and
   ``examples`` (``from stoker.format import _remote`` -> ``from stoker.dataset import _remote``,
   ``"stoker.format._remote.open_store"`` in a monkeypatch string, ...), and the private paths in the docs;
   ``tests/compat`` (FFCV's paths, tested as such) and ``tests/misc/test_public_api.py`` are left alone;
3. writes a thin re-export module at every old public path (the names frozen in
   ``tests/misc/test_public_api.py``), so that users' imports keep working;
4. sorts imports and formats what it touched (``ruff``).

Hand edits that fix import circles (code moved between modules) are separate commits after the one
this script makes: see ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import argparse
import ast
import glob
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
SRC = ROOT / "src"
BIN = Path(sys.executable).parent

#: old module -> new module; True: a public path, kept as a re-export module
MOVES: list[tuple[str, str, bool]] = [
    # datasets of many files: manifests, transactions, sharded reading and writing, opening a URL, mixing
    ("stoker.format.sharded", "stoker.dataset.sharded", True),
    ("stoker.format.shards", "stoker.dataset.shards", True),
    ("stoker.format.mixed", "stoker.dataset.mixed", True),
    ("stoker.format._manifest", "stoker.dataset._manifest", False),
    ("stoker.format._transaction", "stoker.dataset._transaction", False),
    ("stoker.format._vstore", "stoker.dataset._vstore", False),
    # (every format/_remote*.py: the remote opening of shards and the remote transaction, see _globbed)
    # conversion from other formats
    ("stoker.format.imagefolder", "stoker.convert.imagefolder", True),
    ("stoker.integrations.arrow", "stoker.convert.arrow", True),
    ("stoker.integrations.ray", "stoker.convert.ray", True),
    # decoders: the operations that read fields, apart from the fields' schema and encoders
    ("stoker.fields.decoders", "stoker.decoders.arrays", True),
    ("stoker.fields.rgb_image_decoders", "stoker.decoders.rgb_image", True),
    ("stoker.fields._decoder_base", "stoker.decoders._base", False),
    # a compiled copy kernel, used by the decoders and the image kernels
    ("stoker.fields._copy", "stoker.image._copy", False),
    # the per-field pipelines the Loader plans (they know the transforms): the Loader's planning
    ("stoker.pipeline.graph", "stoker.loader._graph", True),
]

#: names a package exported that now live in another package: package -> {name: new module}
NAME_MOVES: dict[str, dict[str, str]] = {
    "stoker.format": {
        "ShardedReader": "stoker.dataset",
        "open_dataset": "stoker.dataset",
        "ShardedWriter": "stoker.dataset",
        "write_shards": "stoker.dataset",
    },
    "stoker.integrations": {
        name: "stoker.convert" for name in ("from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_ray_dataset")
    },
    # FFCV's path for every decoder (the image decoders too): the decoders package exports them all
    "stoker.decoders.arrays": {
        name: "stoker.decoders"
        for name in (
            "BytesDecoder",
            "CenterCropRGBImageDecoder",
            "FloatDecoder",
            "IntDecoder",
            "NDArrayDecoder",
            "RaggedArrayDecoder",
            "RandomResizedCropRGBImageDecoder",
            "SimpleRGBImageDecoder",
        )
    },
}

#: the loopback test servers leave the installed package (tests and benchmarks import them)
LOOPBACK_OLD = "src/stoker/remote/loopback.py"
LOOPBACK_NEW = "benchmarks/_servers/loopback.py"

NEW_PACKAGES = {
    "stoker.dataset": '''"""Datasets of many files: a folder (or URL) of shards and its manifest, read and written as one dataset.

::

    _manifest.py            the manifest: shard names, sizes, checksums, the fields' hash
    _transaction.py         writing a folder of shards as one transaction (manifest last, atomically)
    _remote_transaction.py  the same transaction against an object store
    _vstore.py              several files (or a bounded page cache of them) seen as one array
    sharded.py              ShardedReader and open_dataset: a folder of shards read as one Reader
    shards.py               ShardedWriter and write_shards
    _remote*.py             opening a dataset at a URL: heads, shard downloads through the node cache
    mixed.py                several datasets mixed into one

Below the Loader, above the single file (:mod:`stoker.format`) and the storage (:mod:`stoker.remote`).
"""

from stoker.dataset.sharded import ShardedReader, open_dataset
from stoker.dataset.shards import ShardedWriter, write_shards

__all__ = ["ShardedReader", "ShardedWriter", "open_dataset", "write_shards"]
''',
    "stoker.convert": '''"""Conversion from other formats into stoker files and shards.

::

    imagefolder.py  a folder of images in class sub-folders (``stoker convert imagefolder``)
    arrow.py        Arrow tables, Parquet files, Hugging Face datasets (needs ``pyarrow``)
    ray.py          a ``ray.data.Dataset``, written by Ray's tasks (needs ``ray[data]``)

WebDataset tar shards are read by the writer itself (``DatasetWriter.from_webdataset``, FFCV's
method; :mod:`stoker.format._webdataset`). Nothing here imports ``pyarrow``, ``datasets`` or ``ray``
until a function is called.
"""

from stoker.convert.arrow import from_huggingface, from_parquet, infer_fields, write_arrow
from stoker.convert.imagefolder import convert_image_folder
from stoker.convert.ray import write_ray_dataset

__all__ = ["convert_image_folder", "from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_ray_dataset"]
''',
    "stoker.decoders": '''"""Decoders: the operations that read a field's stored values into batch memory.

::

    _base.py      the decoder base class and its field-type check
    arrays.py     IntDecoder, FloatDecoder, NDArrayDecoder, BytesDecoder, RaggedArrayDecoder
    rgb_image.py  SimpleRGBImageDecoder, CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder

They sit above the fields' schema (:mod:`stoker.fields`), the pipeline's compiler
(:mod:`stoker.pipeline`) and the image kernels (:mod:`stoker.image`).
FFCV's paths (``stoker.fields.decoders``, ``stoker.fields.rgb_image``) re-export them.
"""

from stoker.decoders.arrays import BytesDecoder, FloatDecoder, IntDecoder, NDArrayDecoder, RaggedArrayDecoder
from stoker.decoders.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder

__all__ = [
    "BytesDecoder",
    "CenterCropRGBImageDecoder",
    "FloatDecoder",
    "IntDecoder",
    "NDArrayDecoder",
    "RaggedArrayDecoder",
    "RandomResizedCropRGBImageDecoder",
    "SimpleRGBImageDecoder",
]
''',
}

#: package __init__ files that become compatibility modules (their old content is replaced)
PACKAGE_FACADES = {
    "stoker.integrations": '''"""Compatibility path: converting other libraries' datasets lives in :mod:`stoker.convert` (issue 31).

``from stoker.integrations import write_arrow`` and ``stoker.integrations.arrow`` / ``.ray`` keep working.
"""

from stoker.convert.arrow import from_huggingface, from_parquet, infer_fields, write_arrow
from stoker.convert.ray import write_ray_dataset

__all__ = ["from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_ray_dataset"]
''',
    "stoker.format": '''"""The single stoker file: its layout (:mod:`stoker.format.spec`), reader, writer and data check.

::

    spec.py         the on-disk layout (magic, version, header, field table), and nothing else
    reader.py       Reader: one file, memory-mapped, checked at open
    writer.py       DatasetWriter (and its workers, write-behind sink, atomic publishing)
    _verify.py      the data check: per-block CRC-32, lazily, once per block
    _validated.py   the record of files already checked whole
    _webdataset.py  WebDataset tar shards as the writer's input (FFCV's ``from_webdataset``)

Datasets of many files (``ShardedReader``, ``write_shards``, ...) live in :mod:`stoker.dataset`;
they are still offered here, imported on first use, for code that imports them from this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stoker.format.reader import Reader
from stoker.format.writer import DatasetWriter

if TYPE_CHECKING:
    from stoker.dataset.sharded import ShardedReader, open_dataset
    from stoker.dataset.shards import ShardedWriter, write_shards

__all__ = ["DatasetWriter", "Reader", "ShardedReader", "ShardedWriter", "open_dataset", "write_shards"]

_DATASET = ("ShardedReader", "ShardedWriter", "open_dataset", "write_shards")


def __getattr__(name: str) -> Any:
    # compatibility: the sharded names moved up to stoker.dataset (issue 31); imported on first use so that
    # importing the single-file layer never imports the layer above it
    if name in _DATASET:
        import stoker.dataset

        return getattr(stoker.dataset, name)
    raise AttributeError(f"module 'stoker.format' has no attribute {name!r}")
''',
}


def run(*args: str | Path, check: bool = True) -> str:
    out = subprocess.run([str(a) for a in args], cwd=ROOT, check=check, capture_output=True, text=True)
    return out.stdout


def module_path(module: str) -> Path:
    rel = Path(*module.split("."))
    pkg = SRC / rel / "__init__.py"
    return pkg if pkg.exists() else SRC / rel.with_suffix(".py")


def package_init(package: str) -> Path:
    return SRC / Path(*package.split(".")) / "__init__.py"


def globbed() -> list[tuple[str, str, bool]]:
    """MOVES, plus every ``format/_remote*.py`` (this branch's and any another branch added)."""
    moves = list(MOVES)
    for path in sorted(glob.glob(str(SRC / "stoker" / "format" / "_remote*.py"))):
        name = Path(path).stem
        moves.append((f"stoker.format.{name}", f"stoker.dataset.{name}", False))
    return moves


def frozen_api() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "tests" / "misc" / "test_public_api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id == "FROZEN":
                return ast.literal_eval(node.value)  # type: ignore[arg-type]
    raise SystemExit("tests/misc/test_public_api.py has no FROZEN table")


# ---- import rewriting ---------------------------------------------------------------------------------

FROM_RE = re.compile(r"^(?P<indent>[ \t]*)from (?P<pkg>stoker(?:\.\w+)*) import (?P<names>[^()\n#]+?)(?P<tail>[ \t]*#.*)?$", re.M)
FROM_PAREN_RE = re.compile(r"^(?P<indent>[ \t]*)from (?P<pkg>stoker(?:\.\w+)*) import \((?P<names>[^)]*)\)(?P<tail>[ \t]*#.*)?$", re.M)


def dotted(text: str, moves: dict[str, str]) -> str:
    for old in sorted(moves, key=len, reverse=True):
        text = re.sub(r"(?<![\w.])" + re.escape(old) + r"(?!\w)", moves[old], text)
    return text


def split_from(match: re.Match[str], moves: dict[str, str]) -> str:
    indent, pkg, tail = match["indent"], match["pkg"], match["tail"] or ""
    pkg = dotted(pkg, moves)
    names = re.sub(r"#[^\n]*", "", match["names"])
    moved = [n.partition(" as ")[0].strip() for n in names.split(",")]
    if not any(f"{pkg}.{n}" in moves or n in NAME_MOVES.get(pkg, {}) for n in moved):
        return match[0].replace(f"from {match['pkg']} import", f"from {pkg} import", 1)
    groups: dict[str, list[str]] = {}
    for item in (part.strip() for part in names.split(",")):
        if not item:
            continue
        name, _, alias = item.partition(" as ")
        name, alias = name.strip(), alias.strip()
        target, new_name = pkg, name
        sub = f"{pkg}.{name}"
        if sub in moves:  # a moved submodule: from stoker.format import _remote -> from stoker.dataset import _remote
            target, new_name = moves[sub].rsplit(".", 1)
            if new_name != name and not alias:
                alias = name
        elif name in NAME_MOVES.get(pkg, {}):
            target = NAME_MOVES[pkg][name]
        groups.setdefault(target, []).append(f"{new_name} as {alias}" if alias else new_name)
    lines = [f"{indent}from {target} import {', '.join(names)}" for target, names in groups.items()]
    lines[0] += tail
    return "\n".join(lines)


def rewrite_code(text: str, moves: dict[str, str]) -> str:
    text = FROM_PAREN_RE.sub(lambda m: split_from(m, moves), text)
    text = FROM_RE.sub(lambda m: split_from(m, moves), text)
    return dotted(text, moves)


def rewrite_loopback(path: Path, text: str) -> str:
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("benchmarks/"):
        if rel == "benchmarks/mosaic/selftest.py" and "from stoker.remote" in text:  # _servers is in the folder above
            text = text.replace(
                "sys.path.insert(0, os.fspath(HERE))\n",
                "sys.path.insert(0, os.fspath(HERE))\nsys.path.insert(0, os.fspath(HERE.parent))  # benchmarks/: _servers\n",
            )
        text = text.replace("from stoker.remote.loopback import", "from _servers.loopback import")
        text = text.replace("from stoker.remote import loopback", "from _servers import loopback")
    else:
        text = text.replace("from stoker.remote.loopback import", "from benchmarks._servers.loopback import")
        text = re.sub(
            r"from stoker\.remote import ([^\n]*)\bloopback\b,? ?",
            r"from benchmarks._servers import loopback\nfrom stoker.remote import \1",
            text,
        )
        text = text.replace("from stoker.remote import \n", "")
    return text.replace("stoker.remote.loopback", "benchmarks._servers.loopback")


#: where a compatibility module takes its names from, when not from the module that moved
FACADE_SOURCE = {"stoker.fields.decoders": "stoker.decoders"}  # FFCV's path for every decoder, the image ones too


def facade(old: str, new: str, names: list[str]) -> str:
    source = FACADE_SOURCE.get(old, new)
    head = f'"""Compatibility path: ``{old}`` is :mod:`{new}` (moved in issue 31); kept for code that imports it."""\n\n'
    if not names:
        return head
    body = f"from {source} import {', '.join(names)}\n\n__all__ = [{', '.join(repr(n) for n in names)}]\n"
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="print the moves, change nothing")
    args = ap.parse_args()
    moves = globbed()
    if args.dry:
        for old, new, keep in moves:
            print(f"{old} -> {new}{'  (re-export kept)' if keep else ''}")
        return
    if run("git", "status", "--porcelain", "--untracked-files=no").strip():
        raise SystemExit("the working tree has changes: run this on a clean tree")
    api = frozen_api()
    mapping = {old: new for old, new, _ in moves}

    # 1. the moves
    touched: list[Path] = []
    for pkg in NEW_PACKAGES:
        package_init(pkg).parent.mkdir(parents=True, exist_ok=True)
    for old, new, _ in moves:
        src, dst = module_path(old), SRC / Path(*new.split(".")).with_suffix(".py")
        dst.parent.mkdir(parents=True, exist_ok=True)
        run("git", "mv", src, dst)
    if (ROOT / LOOPBACK_OLD).exists():
        (ROOT / LOOPBACK_NEW).parent.mkdir(parents=True, exist_ok=True)
        run("git", "mv", LOOPBACK_OLD, LOOPBACK_NEW)
        touched.append(ROOT / LOOPBACK_NEW)
        remote_init = SRC / "stoker" / "remote" / "__init__.py"  # its tree no longer lists the servers
        text = remote_init.read_text()
        text = re.sub(r"\n    loopback\.py [^\n]*(\n {18}[^\n]*)*", "", text)
        text = text.replace("the format and the loader use it", "the datasets (:mod:`stoker.dataset`) and the loader use it")
        remote_init.write_text(text + "")
        touched.append(remote_init)
        servers = ROOT / LOOPBACK_NEW  # benchmarks/ allow assert: the package's noqa would be unused there
        servers.write_text(servers.read_text().replace("  # noqa: S101 - ", "  # "))
        (ROOT / LOOPBACK_NEW).parent.joinpath("__init__.py").write_text(
            '"""Real servers on 127.0.0.1 for the tests and benchmarks (moved out of the installed package in issue 31)."""\n'
        )

    # 2. imports and dotted paths
    skip = {ROOT / "tests" / "misc" / "test_public_api.py"}
    for top in ("src", "tests", "benchmarks", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path in skip or (ROOT / "tests" / "compat") in path.parents:
                continue
            text = path.read_text()
            new_text = rewrite_loopback(path, rewrite_code(text, mapping))
            if new_text != text:
                path.write_text(new_text)
                touched.append(path)
    # FFCV's paths are tested as such in tests/compat; only the modules that define the names (the third column of
    # test_ffcv_imports.py's table, and its constants) follow the moves
    compat = ROOT / "tests" / "compat" / "test_ffcv_imports.py"
    if compat.exists():
        text = compat.read_text()
        new_text = re.sub(r'^(_[A-Z_]+ = ")([\w.]+)(")$', lambda m: m[1] + dotted(m[2], mapping) + m[3], text, flags=re.M)
        new_text = re.sub(r'(\(\s*"[\w.]+",\s*"\w+",\s*")([\w.]+)(")', lambda m: m[1] + dotted(m[2], mapping) + m[3], new_text)
        if new_text != text:
            compat.write_text(new_text)
            touched.append(compat)
    private = {old: new for old, new in mapping.items() if "._" in old or old == "stoker.pipeline.graph"}
    for path in sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", *ROOT.glob("benchmarks/**/*.md")]):
        text = path.read_text()
        new_text = dotted(text, private).replace("stoker.remote.loopback", "benchmarks/_servers/loopback.py ")
        for old, new in private.items():  # file paths too: `stoker/format/_manifest.py`
            new_text = new_text.replace("/".join(old.split(".")) + ".py", "/".join(new.split(".")) + ".py")
        new_text = new_text.replace("benchmarks/_servers/loopback.py .", "benchmarks._servers.loopback.")
        if new_text != text:
            path.write_text(new_text)

    # 3. new packages and compatibility modules
    arrays = SRC / "stoker" / "decoders" / "arrays.py"  # the image decoders are the package's to export, not arrays'
    text = arrays.read_text()
    tail = re.search(r"\nfrom stoker\.decoders\.rgb_image import [^\n]*# noqa: E402\n", text)
    if tail:
        text = text.replace(tail[0], "\n")
        for name in ("CenterCropRGBImageDecoder", "RandomResizedCropRGBImageDecoder", "SimpleRGBImageDecoder"):
            text = re.sub(rf'\n\s*"{name}",', "", text)
        arrays.write_text(text)
    for pkg, text in NEW_PACKAGES.items():
        package_init(pkg).write_text(text)
    for pkg, text in PACKAGE_FACADES.items():
        module_path(pkg).write_text(text)
    for old, new, keep in moves:
        if keep:
            path = SRC / Path(*old.split(".")).with_suffix(".py")
            path.write_text(facade(old, new, api.get(old, [])))
            touched.append(path)
    paths = [str(p) for p in touched if p.exists()] + [str(package_init(p)) for p in (*NEW_PACKAGES, *PACKAGE_FACADES)]
    run("git", "add", "-A", "src", "tests", "benchmarks", "examples", "docs", "README.md")

    # 4. tidy
    run(BIN / "ruff", "check", "--fix", "--select", "I,RUF022", *paths, check=False)
    run(BIN / "ruff", "format", *paths, check=False)
    run("git", "add", "-A", "src", "tests", "benchmarks", "examples", "docs", "README.md")
    print(f"moved {len(moves)} modules and the loopback servers; rewrote {len(touched)} files")


if __name__ == "__main__":
    main()
