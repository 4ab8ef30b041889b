"""``python -m collectives``: the environment report (:mod:`collectives.envreport`)."""
import sys

from .envreport import main

if __name__ == "__main__":
    sys.exit(main())
