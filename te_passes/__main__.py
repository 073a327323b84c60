"""``python -m te_passes``: the ``te-passes`` CLI (:func:`te_passes.cli.main`)."""

import sys

from te_passes.cli import main

if __name__ == "__main__":
    sys.exit(main())
