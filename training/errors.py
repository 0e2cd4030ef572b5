"""The run error type, and which errors reach the user as one line (no traceback)."""

from __future__ import annotations

from checkpoint.errors import CheckpointError
from common.hub import HubError
from data.errors import DataError


class RunError(Exception):
    """A user-facing problem with the run's inputs: one line naming the key or file."""


# Raised by our own code with a one-line message naming the file or key; anything else is a bug (traceback).
USER_ERRORS = (RunError, DataError, CheckpointError, HubError)
