"""The one exception the API raises on purpose; app.py renders it as ``{"error": {"code", "message"}}``."""

from __future__ import annotations


class ApiError(Exception):
    """A client-facing error: HTTP status, a stable machine code and one human-readable line."""

    def __init__(
        self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


class TransientError(Exception):
    """Trouble that passes (a store or database that cannot be reached): an upload gets a 503 with
    ``Retry-After``, an analysis is retried with backoff. ``str(err)`` is shown to users, so it
    never names endpoints, buckets, keys or paths: the raiser logs those."""


def not_found(what: str, ident: object) -> ApiError:
    """Missing and not-yours look the same, so ids of other teams leak nothing."""
    return ApiError(404, "not_found", f"{what} {ident} not found")


# Ids are 32-bit on PostgreSQL (SERIAL); anything outside cannot exist, so it is simply not found
# (rather than a driver overflow error surfacing as a 500).
MAX_ID = 2**31 - 1


def check_id(what: str, ident: int) -> int:
    """``ident`` if it can name a row, else the same 404 a missing row gets."""
    if not 0 < ident <= MAX_ID:
        raise not_found(what, ident)
    return ident
