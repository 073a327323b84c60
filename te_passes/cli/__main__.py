"""``python -m te_passes.cli``: the ``te-passes`` CLI (:func:`te_passes.cli.main`)."""

import sys

from te_passes.cli.main import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
