"""The checkpoint error type, shared by every reader and writer in this package."""


class CheckpointError(Exception):
    """A checkpoint is missing, truncated, unsafe or does not match what is expected. One-line message."""
