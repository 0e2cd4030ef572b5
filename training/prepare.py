"""`python -m training.prepare`, the name `python -m data.prepare` had before its code moved to data/prepare.py."""

import sys

from data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
