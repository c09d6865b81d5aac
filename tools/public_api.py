"""Print every public module of stoker and its public names, as the literal frozen in tests/misc/test_public_api.py.

Run from a repository root with the package on the path: ``PYTHONPATH=src python tools/public_api.py``.
A public module is one whose dotted path has no part starting with ``_``; its public names are its
``__all__`` when it has one, else every attribute not starting with ``_`` that is not a module and not
an object defined outside stoker (``np``, ``Any``, ...). FFCV's lazily re-exported decoder names
(``stoker.fields.basics.IntDecoder``) are added from each module's ``_REEXPORTS`` table.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import pprint
import re
import subprocess
import types

import stoker


def public_modules() -> list[str]:
    names = ["stoker"]
    for info in pkgutil.walk_packages(stoker.__path__, "stoker."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        names.append(info.name)
    return sorted(names)


def public_names(module: types.ModuleType) -> list[str]:
    if hasattr(module, "__all__"):
        names = set(module.__all__)
    else:
        names = set()
        for name, value in vars(module).items():
            if name.startswith("_") or name == "TYPE_CHECKING" or isinstance(value, types.ModuleType):
                continue
            home = getattr(value, "__module__", None)
            if isinstance(value, type) or callable(value):
                if not (isinstance(home, str) and home.startswith("stoker")):
                    continue
            elif home is not None and not str(home).startswith("stoker"):
                continue
            names.add(name)
    names |= set(getattr(module, "_REEXPORTS", {}))
    return sorted(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-test", metavar="PATH", help="replace FROZEN (and the commit it names) in this test file")
    args = ap.parse_args()
    api = {}
    for name in public_modules():
        api[name] = public_names(importlib.import_module(name))
    if not args.write_test:
        pprint.pprint(api, width=120, compact=True, sort_dicts=True)
        return
    with open(args.write_test) as fh:
        text = fh.read()
    start = text.index("FROZEN: dict[str, list[str]] = {")
    end = text.index("\n}\n", start) + 3
    body = pprint.pformat(api, width=120, compact=True, sort_dicts=True)
    text = text[:start] + "FROZEN: dict[str, list[str]] = " + body + "\n" + text[end:]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    text = re.sub(r"from main at \w+", f"from main at {commit}", text)
    with open(args.write_test, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
