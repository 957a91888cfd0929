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

from trajstore.errors import UsageError

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
    return _env_number(TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT_S, float, "seconds above 0", 0.0)


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
    return int(_env_number(QUEUE_ENV, DEFAULT_MAX_QUEUED_REPLAYS, int, "a count from 0", -1))


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


#: bytes of encoded payload bodies the server keeps by ETag, in MiB
CACHE_MB_ENV = "TRAJSTORE_API_CACHE_MB"
DEFAULT_CACHE_MB = 512


def _env_number(
    name: str, default: float, parse: type[int] | type[float], what: str, above: float
) -> float:
    """The number `name` holds in the environment (`default` when unset or empty); a
    value that is not a number of that kind above `above` is a `UsageError` naming the
    variable: a server never runs on a setting it guessed (`trajstore serve` checks them
    all at start, `check_environment`)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not value > above or value != value or value == float("inf"):
        raise UsageError(f"{name}={raw!r:.40}: expected {what}")
    return value


def max_buffered_bytes() -> int:
    """`TRAJSTORE_API_MAX_BUFFERED_BYTES` (default 2 GiB); read once at app start."""
    return int(_env_number(MAX_BUFFERED_ENV, DEFAULT_MAX_BUFFERED_BYTES, int, "bytes from 0", -1))


def serial_build_bytes() -> int:
    """`TRAJSTORE_API_SERIAL_BUILD_BYTES` (default 64 MiB); read once at app start."""
    return int(_env_number(SERIAL_BUILD_ENV, DEFAULT_SERIAL_BUILD_BYTES, int, "bytes from 0", -1))


def body_cache_bytes() -> int:
    """`TRAJSTORE_API_CACHE_MB` (default 512; 0: keep no body) in bytes; read at app start."""
    return int(_env_number(CACHE_MB_ENV, DEFAULT_CACHE_MB, int, "MiB from 0", -1)) << 20


#: the bearer token of the REST API (read by api.app)
TOKEN_ENV = "TRAJSTORE_API_TOKEN"


def check_environment() -> None:
    """Raise `UsageError` for the first malformed or unknown TRAJSTORE_API_* setting;
    `trajstore serve` runs it before it binds, so a typo is one line and exit 2, not a
    default (a misspelt token variable would serve without authentication)."""
    known = (TOKEN_ENV, TIMEOUT_ENV, QUEUE_ENV, MAX_BUFFERED_ENV, SERIAL_BUILD_ENV, CACHE_MB_ENV)
    stray = sorted(n for n in os.environ if n.startswith("TRAJSTORE_API_") and n not in known)
    if stray:
        raise UsageError(f"unknown variable {stray[0]} (known: {', '.join(sorted(known))})")
    request_timeout_s()
    max_queued_replays()
    max_buffered_bytes()
    serial_build_bytes()
    body_cache_bytes()
