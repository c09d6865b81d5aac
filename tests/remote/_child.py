"""A process of the cache tests: ``python tests/remote/_child.py '<json>'`` fetches keys into a shared cache.

The JSON: ``url``, ``options`` (storage_options), ``cache_dir``, ``limit``, ``keys`` ([key, size] pairs);
prints the cache's stats as JSON when done.
"""

from __future__ import annotations

import json
import sys

from stoker.remote import ShardCache, open_store


def main() -> None:
    args = json.loads(sys.argv[1])
    cache = ShardCache(open_store(args["url"], args["options"]), args["cache_dir"], args["limit"])
    for key, size in args["keys"]:
        cache.pin(key, size)
        cache.unpin(key)
    print(json.dumps(cache.stats()))


if __name__ == "__main__":
    main()
