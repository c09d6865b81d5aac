"""A process of the exit tests: ``python tests/remote/_exit_child.py '<json>'`` reads from a store, then exits at once.

The JSON: ``url``, ``options`` (storage_options), ``key`` (an object), ``mode``: ``read`` (read ``key``, print
its size), ``missing`` (read a key that does not exist, print the error's class) or ``busy`` (as ``read``, while
daemon threads keep reading ``key``: the process exits with requests in flight).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading

from stoker.errors import RemoteError
from stoker.remote import open_store


def main() -> None:
    args = json.loads(sys.argv[1])
    store = open_store(args["url"], args["options"])
    if args["mode"] == "missing":
        try:
            store.read("no-such-object")
        except RemoteError as exc:
            print(type(exc).__name__)
        return
    if args["mode"] == "busy":

        def reads() -> None:
            while True:
                with contextlib.suppress(RemoteError):
                    store.read(args["key"])

        for i in range(4):
            threading.Thread(target=reads, name=f"reader-{i}", daemon=True).start()
    print(len(store.read(args["key"])))


if __name__ == "__main__":
    main()
