"""`trajstore demo [DIR]`: the main job end to end
(trajstore.examples.demo, as `make demo` runs it)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="the whole job end to end on a local store")
    parser.add_argument("dir", nargs="?", help="store to (re)create (default: ./demo-store)")
    parser.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    # The demo is an example, a user of the library: imported only when asked for.
    from trajstore.examples import demo

    return demo.main(["--store", args.dir] if args.dir else [])
