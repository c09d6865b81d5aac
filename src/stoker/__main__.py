"""``python -m stoker``: the same as the ``stoker`` command."""

import sys

from stoker.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
