"""`trajstore serve`: the REST API (package `api`) under uvicorn.

`api` and uvicorn are imported only when the command runs, so `trajstore
--help` stays cheap and nothing under `trajstore/` imports `api` at load time.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from trajstore.cli._common import add_catalog_arg, default_store

if TYPE_CHECKING:
    import socket


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the REST API over a store (uvicorn; binds 127.0.0.1 by default)",
        description="Serve /v1 over a store. With TRAJSTORE_API_TOKEN set every request needs "
        "'Authorization: Bearer <token>'.",
    )
    p.add_argument(
        "--store", metavar="DIR", default=default_store(), help="store (env TRAJSTORE_STORE)"
    )
    add_catalog_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn log level (default info)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes (default 1); each opens the store and its own catalog snapshot",
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from trajstore.errors import UsageError
    from trajstore.store import Store

    if not args.store:
        raise UsageError("serve needs --store DIR (or TRAJSTORE_STORE)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    if not 1 <= args.workers <= 64:
        raise UsageError(f"--workers must be 1..64, got {args.workers}")
    from trajstore.api.limits import TOKEN_ENV, check_environment

    check_environment()  # a malformed TRAJSTORE_API_* value: one line, before anything starts
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not _loopback(args.host):
        print(
            f"trajstore: warning: serving on {args.host} without {TOKEN_ENV}: anyone who "
            f"reaches port {args.port} can read every bundle of the store",
            file=sys.stderr,
        )
    # fail early, as one line: a missing store, or a catalog that cannot be opened
    with Store.open(args.store, create=False, catalog_url=args.catalog) as store:
        if args.catalog:
            from trajstore.catalog import open_catalog

            open_catalog(store.root, args.catalog).close()
    import uvicorn

    from trajstore.api import app as api_app

    if args.workers > 1:
        # each worker builds its own app (store, catalog snapshot, caches) from the
        # environment: they share the listening socket and the store, nothing else
        os.environ[api_app.STORE_ENV] = str(args.store)
        os.environ[api_app.CATALOG_ENV] = args.catalog or ""
        run_workers(
            "trajstore.api.app:app_from_env",
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            factory=True,
        )
        return 0
    app = api_app.create_app(
        args.store,
        token=token,
        catalog_url=args.catalog,
    )
    from trajstore.api.limits import GuardedH11Protocol

    # uvicorn reports a bind it cannot make in its log and exits 3; say it here, exit 2
    _listening_socket(args.host, args.port).close()
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, http=GuardedH11Protocol
    )
    return 0


def _loopback(host: str) -> bool:
    """Whether `host` is a loopback address or name (only this machine can connect)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_workers(
    app: str, *, host: str, port: int, workers: int, log_level: str, factory: bool = False
) -> None:
    """uvicorn's multi-process mode over a listening socket bound here.

    uvicorn's own bind (`socket.socket(family)`) leaves the protocol number 0, so
    asyncio never sets TCP_NODELAY on the accepted connections and a small
    response waits for the client's delayed ACK (about 40 ms per request, measured
    by scripts/bench/bench_rest.py). A socket opened with IPPROTO_TCP gets it.
    """
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from trajstore.api.limits import GuardedH11Protocol

    # h11 with a deadline per request: a slow or idle client is not held forever
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        workers=workers,
        factory=factory,
        http=GuardedH11Protocol,
    )
    sock = _listening_socket(host, port)
    sock.set_inheritable(True)
    Multiprocess(config, sockets=[sock]).run()


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); a bind that fails (a port in use, a host name
    that does not resolve) is one line and exit 2."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from trajstore.errors import UsageError

        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
