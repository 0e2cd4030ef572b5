"""`python -m data.prepare`, the documented name of `python -m training.prepare` (tokenize a run's data ahead of
training). NOTE: the command composes the trainer's config, so its code lives in training/prepare.py; this module
only keeps the name users and scripts already call."""

import sys

from training.prepare import main

if __name__ == "__main__":
    sys.exit(main())
