"""The `trajstore` command line.

Each command group lives in its own module with ``register(subparsers)``;
modules import only argparse-level things at the top, so ``trajstore
--help`` does not pay for torch, zarr or duckdb. Every TrajstoreError becomes
one line on stderr and its exit code; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trajstore import __version__
from trajstore.errors import CatalogDamagedError, TrajstoreError, disk_full_error

#: command modules, in the order their commands appear in --help
COMMAND_MODULES = [
    "trajstore.cli.bundle_cmds",
    "trajstore.cli.replay_cmd",
    "trajstore.cli.store_cmds",
    "trajstore.cli.query_cmds",
    "trajstore.cli.router_cmd",
    "trajstore.cli.serve_cmd",
    "trajstore.cli.demo_cmd",
]

#: each command and the module that registers it: a command line naming one builds the
#: parser of that module only (argparse's subparsers cost ~20 ms a module here, mostly
#: gettext lookups). tests/test_cli_imports.py pins this against the modules' register().
COMMANDS = {
    **dict.fromkeys(("inspect", "validate"), "trajstore.cli.bundle_cmds"),
    "replay": "trajstore.cli.replay_cmd",
    **dict.fromkeys(
        ("ingest", "export", "ls", "stats", "fsck", "rm", "gc", "reindex"),
        "trajstore.cli.store_cmds",
    ),
    **dict.fromkeys(("query", "sql", "diff"), "trajstore.cli.query_cmds"),
    "router": "trajstore.cli.router_cmd",
    "serve": "trajstore.cli.serve_cmd",
    "demo": "trajstore.cli.demo_cmd",
}

EXIT_CODES_HELP = """exit codes:
  0  success / every requested stage passes
  1  a divergence was found, or a requested stage is unsupported
  2  invalid input, integrity failure, refused selection or usage error,
     a full disk or exhausted quota (ENOSPC/EDQUOT: free space and rerun)
     (also an internal error; TRAJSTORE_DEBUG=1 shows its traceback)
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or only of `command`'s module when it is one of
    COMMANDS (the same subparser, so the same usage, help and errors)."""
    parser = argparse.ArgumentParser(
        prog="trajstore",
        description="Store and replay what asynchronous RL training actually consumed.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trajstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in [COMMANDS[command]] if command in COMMANDS else COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _command_of(argv: list[str] | None) -> str | None:
    """The command a command line names: its first word (the top-level options take no
    value, so a command line whose first word is one of them is parsed in full)."""
    words = sys.argv[1:] if argv is None else argv
    return words[0] if words and words[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        parser = build_parser(_command_of(argv))
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        _expand_store(args)
        return int(args.func(args) or 0)
    except TrajstoreError as exc:
        if isinstance(exc, CatalogDamagedError):
            exc.reindex_args = _reindex_args(args) or exc.reindex_args
        print(f"trajstore: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("trajstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug, not bad input: still one line unless asked
        # A full disk (an OSError, or a catalog driver's error saying so) is the user's to
        # fix, not a bug: one line and exit 2, like any refused input.
        full = disk_full_error(exc)
        if full is not None:
            print(f"trajstore: error: {full}", file=sys.stderr)
            return full.exit_code
        return _internal(exc)


def _expand_store(args: argparse.Namespace) -> None:
    """--store (or $TRAJSTORE_STORE) with a leading `~` expanded once, so every command
    and its messages name the directory used (`jsonio.user_path`)."""
    store = getattr(args, "store", None)
    if isinstance(store, str) and store.startswith("~"):
        from trajstore.jsonio import user_path

        args.store = str(user_path(store))


def _reindex_args(args: argparse.Namespace | None) -> str | None:
    """The `--store` (and `--catalog`) of this command line, for `trajstore reindex`: the
    store as the user named it (an S3 store's catalog file lives in a cache directory)."""
    import shlex

    store = getattr(args, "store", None)
    if not store:
        return None
    catalog = getattr(args, "catalog", None)
    return f"--store {shlex.quote(str(store))}" + (
        f" --catalog {shlex.quote(catalog)}" if catalog else ""
    )


def _internal(exc: Exception) -> int:
    if os.environ.get("TRAJSTORE_DEBUG"):
        raise exc
    print(
        f"trajstore: internal error: {type(exc).__name__}: {exc} "
        "(rerun with TRAJSTORE_DEBUG=1 for the traceback, and please report it)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
