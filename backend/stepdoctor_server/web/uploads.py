"""What every upload route does to its raw body before a domain sees it: a declared length over
the limit is refused before a byte is read, and a small body is read whole under that limit."""

from __future__ import annotations

from fastapi import Request

from stepdoctor_server.core.errors import ApiError
from stepdoctor_server.traces.storage import too_large


def check_declared_length(
    content_length: str | None, max_bytes: int, refused: ApiError | None = None
) -> None:
    """400 for a Content-Length that is not a number; ``refused`` (default: the upload 413) when it
    declares more than ``max_bytes``."""
    if content_length is None:
        return
    try:
        declared = int(content_length)
    except ValueError:
        raise ApiError(400, "invalid_content_length", "Content-Length is not an integer") from None
    if declared > max_bytes:
        raise refused or too_large(max_bytes)


async def read_bounded(request: Request, max_bytes: int, refused: ApiError) -> bytes:
    """The whole body, for bodies kept in memory (series chunks); ``refused`` once it passes
    ``max_bytes``, whatever the Content-Length said (a chunked body declares none)."""
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise refused
    return bytes(body)
