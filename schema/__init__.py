"""The run configuration's schema: typed dataclasses, the values derived from them, the checks that need nothing
but the config, and composing it from conf/ and command-line overrides.

The bottom floor: it imports nothing of ours, so every package (models/, data/, checkpoint/, training/) and every
command (trainer.py, `python -m data.prepare`, tools/) reads the same config without importing upward.
"""
