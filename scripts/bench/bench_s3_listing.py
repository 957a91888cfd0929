#!/usr/bin/env python
"""Names listed per command on an S3 store: a cold cache (every command before the
incremental listing) vs a warm one, on a loopback SeaweedFS server.

    .venv/bin/python scripts/bench/bench_s3_listing.py [--refs 200 --per-command 20]

Publishes `refs` small bundles (`per-command` per ingest command), then
counts the names the S3 listings return (`S3RefSpace.listed` + `S3ObjectStore.listed`)
for two commands, each in a fresh `Store.open` as a new process would: ingest of one
new bundle published meanwhile by another host's cache, and a step lookup. A count,
not a time: the cost that grows with the store is one listing request per 1,000 names.
The margin is set to 0 for the warm figures (what is listed beyond the new names is the
mark itself); with the default 300 s everything published in the last 5 minutes is
listed again, which in this short run is everything.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the loopback S3 server and bundle factory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", type=int, default=200)
    ap.add_argument("--per-command", type=int, default=20)
    args = ap.parse_args()
    from conftest import make_contents
    from s3server import BUCKET, s3_server

    from trajstore.bundle.writer import write_bundle
    from trajstore.store import Store

    def bundle(tmp: Path, step: int) -> Path:
        return write_bundle(tmp / f"b{step}" / f"replay-7-{step}", make_contents(step_id=step))

    def counted(url: str, cache: Path, command: str, step: int, tmp: Path) -> tuple[int, int]:
        os.environ["TRAJSTORE_CACHE_DIR"] = str(cache)
        with Store.open(url) as store:
            if command == "ingest":
                store.ingest([bundle(tmp, step)])
            else:
                store.step("default", 7, step)
            return store.space.listed, store.objs.listed

    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with s3_server(tmp / "seaweedfs") as server:
            os.environ.update(server.env())
            os.environ["TRAJSTORE_CATALOG_MARGIN_S"] = "0"
            url = f"s3://{BUCKET}/listing"
            os.environ["TRAJSTORE_CACHE_DIR"] = str(tmp / "writer")
            for start in range(0, args.refs, args.per_command):
                with Store.open(url) as store:
                    steps = range(start, min(start + args.per_command, args.refs))
                    store.ingest([bundle(tmp, s) for s in steps])
            warm = tmp / "warm"
            counted(url, warm, "lookup", 0, tmp)  # warms this host's cache
            step = args.refs
            for command in ("ingest", "lookup"):
                # another host publishes one bundle, then this host runs the command
                counted(url, tmp / "other", "ingest", step, tmp)
                # the ingests publish different bundles; the lookups find the same one
                cold_target, hot_target = (
                    (step + 1, step + 2) if command == "ingest" else (step,) * 2
                )
                cold = counted(url, tmp / f"cold-{command}", command, cold_target, tmp)
                hot = counted(url, warm, command, hot_target, tmp)
                rows.append((command, cold, hot))
                step += 3
    print(
        f"\nS3 store of {args.refs} refs, ingested {args.per_command} per command; SeaweedFS weed "
        f"mini on 127.0.0.1; {platform.machine()}, {os.cpu_count()} CPUs; margin 0\n"
    )
    print(
        "| command (after one new bundle from another host) | cold cache: ref names "
        "| pack names | warm cache: ref names | pack names |"
    )
    print("|---|---:|---:|---:|---:|")
    for command, cold, hot in rows:
        what = "ingest of one bundle" if command == "ingest" else "step lookup"
        print(f"| {what} | {cold[0]} | {cold[1]} | {hot[0]} | {hot[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
