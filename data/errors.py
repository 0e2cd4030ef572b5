"""The data error type, shared by the readers and the datasets."""


class DataError(ValueError):
    """Bad data: the message names the file (and line or row)."""
