"""Bounds on what one client can make the server hold (docs/rest.md#limits).

Two gaps a hostile client found in the stack below the endpoints
(docs/reliability.md, test 4):

- Request bodies: Starlette reads a body into memory whole before FastAPI
  validates it, so a 300 MB POST to ``/v1/replay`` grew the server by
  630 MB. `BodyLimit` refuses a body over `MAX_BODY_BYTES` with a JSON 413,
  from its Content-Length before reading it, or as soon as a chunked body
  passes the limit.
- Slow clients: uvicorn's h11 protocol arms its keep-alive timer only after
  a response, so a connection that sends nothing, or half a request line, or
  a body slower than it promised, is held forever (1,500 such connections
  stayed open). `GuardedH11Protocol` closes a connection whose request
  (headers and body) has not fully arrived within `request_timeout_s()`
  of its first byte (or of the connection, for the first request).

And one gap above them: replays (and router comparisons and diffs) run one
at a time, each waiting request holding a thread of the pool (40) that
every sync endpoint shares; `QueueLimitedLock` refuses one more waiter
than `max_queued_replays()` with a JSON 503 `busy` instead of letting a
flood of them take every thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import ApiError, error_response

#: the largest request body accepted (the only body is POST /v1/replay's selection:
#: 10,000 ids of 200 characters each fit)
MAX_BODY_BYTES = 4 << 20
#: seconds a client has to deliver one whole request (headers and body)
TIMEOUT_ENV = "TRAJSTORE_API_REQUEST_TIMEOUT_S"
DEFAULT_REQUEST_TIMEOUT_S = 30.0


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"request body over {limit} bytes")


class BodyLimit:
    """Pure ASGI middleware: a request body over `max_bytes` is answered 413 (JSON)."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared and (
            len(declared) > 18 or not declared.isdigit() or int(declared) > self.max_bytes
        ):
            exc = _too_large(self.max_bytes)
            await error_response(exc.status_code, exc.code, exc.detail)(scope, receive, send)
            return
        received = 0

        async def limited() -> dict:
            # FastAPI re-raises an HTTPException from the body read: the handlers answer it
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)
            return message

        await self.app(scope, limited, send)


def request_timeout_s() -> float:
    """`TRAJSTORE_API_REQUEST_TIMEOUT_S` (default 30); read per connection, so tests can set it."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_REQUEST_TIMEOUT_S)
    except ValueError:
        return DEFAULT_REQUEST_TIMEOUT_S
    return value if value > 0 else DEFAULT_REQUEST_TIMEOUT_S


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for receiving each request.

    The deadline is armed when the connection opens and when the first bytes
    of a later request arrive, and is cancelled once h11 has the whole request
    (``their_state`` leaves IDLE and SEND_BODY). When it fires with the
    request still incomplete the connection is closed: nothing was dispatched
    to the app yet for a half-sent request line or headers, and a half-sent
    body makes the app's body read end (Starlette sees a disconnect).
    """

    _request_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._request_deadline is None:
            self._arm()  # the first bytes of a new request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._request_deadline = self.loop.call_later(request_timeout_s(), self._expired)

    def _disarm(self) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
            self._request_deadline = None

    def _expired(self) -> None:
        self._request_deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


#: requests allowed to wait for the replay lock (beyond the one holding it)
QUEUE_ENV = "TRAJSTORE_API_MAX_QUEUED_REPLAYS"
DEFAULT_MAX_QUEUED_REPLAYS = 8


def max_queued_replays() -> int:
    """`TRAJSTORE_API_MAX_QUEUED_REPLAYS` (default 8; 0: no waiting, one at a time)."""
    try:
        value = int(os.environ.get(QUEUE_ENV) or DEFAULT_MAX_QUEUED_REPLAYS)
    except ValueError:
        return DEFAULT_MAX_QUEUED_REPLAYS
    return max(value, 0)


class QueueLimitedLock:
    """A lock for ``with``: one holder, at most `max_waiting` waiters; one more is refused
    with `ApiError` 503 ``busy`` (the thread pool stays free for lookups)."""

    def __init__(
        self, max_waiting: int | None = None, what: str = "replays, comparisons or diffs"
    ) -> None:
        self.max_waiting = max_queued_replays() if max_waiting is None else max_waiting
        self.what = what
        self._lock = threading.Lock()
        self._admitted = threading.BoundedSemaphore(self.max_waiting + 1)

    def __enter__(self) -> None:
        if not self._admitted.acquire(blocking=False):
            raise ApiError(
                503,
                "busy",
                f"{self.max_waiting + 1} {self.what} are running or queued; retry later",
            )
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._admitted.release()


#: the largest payload body built in memory (a Range, ?sample=, format=pt or a delta record)
MAX_BUFFERED_ENV = "TRAJSTORE_API_MAX_BUFFERED_BYTES"
DEFAULT_MAX_BUFFERED_BYTES = 2 << 30
#: bodies over this many bytes are built one at a time (`QueueLimitedLock`)
SERIAL_BUILD_ENV = "TRAJSTORE_API_SERIAL_BUILD_BYTES"
DEFAULT_SERIAL_BUILD_BYTES = 64 << 20


def _bytes_from_env(name: str, default: int) -> int:
    """A non-negative byte count from the environment; the default when unset or malformed
    (as the other TRAJSTORE_API_* variables)."""
    try:
        value = int(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if value >= 0 else default


def max_buffered_bytes() -> int:
    """`TRAJSTORE_API_MAX_BUFFERED_BYTES` (default 2 GiB); read once at app start."""
    return _bytes_from_env(MAX_BUFFERED_ENV, DEFAULT_MAX_BUFFERED_BYTES)


def serial_build_bytes() -> int:
    """`TRAJSTORE_API_SERIAL_BUILD_BYTES` (default 64 MiB); read once at app start."""
    return _bytes_from_env(SERIAL_BUILD_ENV, DEFAULT_SERIAL_BUILD_BYTES)
