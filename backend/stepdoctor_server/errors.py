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


def not_found(what: str, ident: object) -> ApiError:
    """Missing and not-yours look the same, so ids of other teams leak nothing."""
    return ApiError(404, "not_found", f"{what} {ident} not found")
