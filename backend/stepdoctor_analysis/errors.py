"""Errors the engine raises for bad input: one clear line for users, never a traceback."""


class TraceError(ValueError):
    """The input is not a usable trace; ``str(err)`` is the one line shown to the user."""


class TraceTooLarge(TraceError):
    """The decompressed trace exceeds the configured cap (e.g. a gzip bomb)."""
