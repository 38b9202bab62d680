#!/usr/bin/env python3
"""Build driver entry point: `python build.py --target gfx906`, `python build.py check-patches`, ..."""
import os
import sys

# the driver is what rebuilds stale libraries: no stale-build warning on its own import
os.environ.setdefault("PYLLAMAPOOL_NO_STALE_WARNING", "1")
from pyllamapool.native.driver import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
