"""The hash of checkpoint files (manifests, `--verify`; checkpoint/manifest.py says why xxh3-128): its name and
constructor, for whoever hashes bytes on their way to disk (checkpoint/direct_io.py) or back."""

from __future__ import annotations

import hashlib

import xxhash

HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # the first is written; an entry's own is checked
HASH = next(iter(HASHES))


def new_digest():
    """A fresh digest of `HASH`."""
    return HASHES[HASH]()
