"""The API key guard (`--api-key`): ASGI middleware that answers 401 with an OpenAI error body.

Its own module so that every app pagedkv serves (the OpenAI server, `pagedkv kv-view`) guards the same way.
"""

from __future__ import annotations

import secrets
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from pagedkv.server.protocol import APIError

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.response_body(), status_code=e.status_code)


class APIKeyMiddleware:
    """401 without `Authorization: Bearer <one of the keys>` (scheme case-insensitive, keys compared in constant
    time), on every route but the open ones; checked before the body is read. On `query_key_paths` (pages a
    browser navigates to, which cannot send a header) `?api_key=<key>` is accepted too."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], open_paths: frozenset[str],
                 query_key_paths: frozenset[str] = frozenset()) -> None:
        self.app, self.keys, self.open_paths = app, [k.encode() for k in api_keys], open_paths
        self.query_key_paths = query_key_paths

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        ok = False
        for key in self.keys:  # every key is compared: the time says nothing about which one was close
            ok |= secrets.compare_digest(token, key)
        return ok and scheme.lower() == b"bearer"

    def _query_key(self, scope: Scope) -> bytes:
        """`?api_key=` as an Authorization header, on the paths that take it (else empty)."""
        if scope["path"] not in self.query_key_paths:
            return b""
        keys = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [""])
        return b"Bearer " + keys[0].encode()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths and scope["method"] != "OPTIONS":
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not self._authorized(header) and not self._authorized(self._query_key(scope)):
                err = APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", 401,
                               type="invalid_request_error", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
