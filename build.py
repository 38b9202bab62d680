#!/usr/bin/env python3
"""Build driver entry point: `python build.py --target gfx906`, `python build.py check-patches`, ..."""
import sys

from pyllamapool.driver import main

if __name__ == "__main__":
    sys.exit(main())
