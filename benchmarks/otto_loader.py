"""Otto loading benchmark: stoker vs ``torch.utils.data.DataLoader`` vs the numpy limit.

The same as ``stoker bench`` (``make bench``); the code lives in
:mod:`stoker.bench`. Options: ``python benchmarks/otto_loader.py --help``.

    python benchmarks/otto_loader.py --out bench-out
    python benchmarks/otto_loader.py --quick --out /tmp/bench
"""

import sys

from stoker.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
