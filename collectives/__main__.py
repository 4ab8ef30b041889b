"""``python -m collectives``: the environment report (:mod:`collectives.diagnostics.envreport`)."""
import sys

from .diagnostics.envreport import main

if __name__ == "__main__":
    sys.exit(main())
