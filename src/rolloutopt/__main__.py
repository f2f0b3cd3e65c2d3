"""``python -m rolloutopt``: the command line (:func:`rolloutopt.cli.main`)."""

from __future__ import annotations

import sys

from rolloutopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
