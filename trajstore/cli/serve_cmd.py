"""`trajstore serve`: the REST API (package `api`) under uvicorn.

`api` and uvicorn are imported only when the command runs, so `trajstore
--help` stays cheap and nothing under `trajstore/` imports `api` at load time.
"""

from __future__ import annotations

import argparse
import os

from trajstore.cli._common import add_catalog_arg, default_store


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
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from trajstore.errors import UsageError
    from trajstore.store import Store

    if not args.store:
        raise UsageError("serve needs --store DIR (or TRAJSTORE_STORE)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    # fail early, as one line: a missing store, or a catalog that cannot be opened
    with Store.open(args.store, create=False, catalog_url=args.catalog) as store:
        if args.catalog:
            from trajstore.catalog import open_catalog

            open_catalog(store.root, args.catalog).close()
    import uvicorn

    from trajstore.api.app import create_app

    app = create_app(
        args.store,
        token=os.environ.get("TRAJSTORE_API_TOKEN") or None,
        catalog_url=args.catalog,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
