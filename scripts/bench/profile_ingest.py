#!/usr/bin/env python
"""Where an ingest's time goes: `trajstore ingest` of a capture, phase by phase (issue 33).

    .venv/bin/python scripts/bench/profile_ingest.py CAPTURE [--reps 3] [--cprofile 30]

Runs `trajstore ingest CAPTURE --store NEW` in this process `--reps` times (after one
warm-up run, dropped) with its phases timed where they run: the integrity gate
(`Ingestor.gate`, its own thread), the writes (`Ingestor.write`, two threads), the
batch's pack flush and its ref creation (`Ingestor.publish_many`) on the finisher
thread. Per phase: calls, wall seconds and thread CPU seconds summed over calls; per
run: wall, process CPU (user + system, all threads), fsync calls and the seconds
threads spent in them, minor page faults. The gate's payload reads run on a pool of
two readers inside `gate`: their CPU is in the process CPU, not in the gate's.

`--cprofile N` also runs the same work on one thread (gate, write, then one flush and
one publish of everything) under cProfile and prints its top N functions by internal
time: the proportions a pipelined run hides. Generate a capture with
`python -m trajstore.examples.gen_long_run` (`bench_store.py`'s sizes are in its
docstring). A measurement tool, not a figure: on a loaded machine only the proportions
and the counts mean something. Prints one JSON object (and the profile table).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def instrument() -> tuple[dict[str, list[float]], collections.Counter]:
    """Wrap the phases and os.fsync with timers; the dicts they fill."""
    from trajstore.cas import packed
    from trajstore.store import ingest

    phases: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    fsyncs: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    p = phases[label]
                    p[0] += 1
                    p[1] += time.perf_counter() - t
                    p[2] += time.thread_time() - c

        return run

    for label, cls, name in (
        ("gate", ingest.Ingestor, "gate"),
        ("write", ingest.Ingestor, "write"),
        ("publish refs", ingest.Ingestor, "publish_many"),
        ("pack flush", packed.PackedObjectStore, "flush"),
    ):
        setattr(cls, name, timed(label, getattr(cls, name)))
    real = os.fsync

    def fsync(fd: int) -> None:
        t = time.perf_counter()
        real(fd)
        with lock:
            fsyncs["calls"] += 1
            fsyncs["seconds"] += time.perf_counter() - t

    os.fsync = fsync
    return phases, fsyncs


def forget_caches() -> None:
    """Empty the per-process caches, so each run costs what a new process's ingest does."""
    from trajstore.cas.arrays import ENCODE_CACHE
    from trajstore.cas.chunk_cache import CHUNK_CACHE

    ENCODE_CACHE.clear()
    CHUNK_CACHE.clear()


def one_run(cap: Path, store: Path, phases: dict, fsyncs: collections.Counter) -> dict[str, Any]:
    from trajstore.cli import main

    shutil.rmtree(store, ignore_errors=True)
    forget_caches()
    phases.clear()
    fsyncs.clear()
    a = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["ingest", str(cap), "--store", str(store), "--run", "bench", "--json"])
    wall = time.perf_counter() - t0
    b = resource.getrusage(resource.RUSAGE_SELF)
    if code != 0:
        raise SystemExit(f"trajstore ingest exited {code}")
    shutil.rmtree(store, ignore_errors=True)
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(b.ru_utime - a.ru_utime + b.ru_stime - a.ru_stime, 3),
        "fsync_calls": fsyncs["calls"],
        "fsync_thread_s": round(fsyncs["seconds"], 3),
        "minor_faults": b.ru_minflt - a.ru_minflt,
        "phases": {
            k: {"calls": n, "wall_s": round(w, 3), "thread_cpu_s": round(c, 3)}
            for k, (n, w, c) in phases.items()
        },
    }


def serial_profile(cap: Path, store: Path, top: int) -> str:
    """The work of one ingest on one thread under cProfile: its top functions."""
    from trajstore.bundle.capture_dir import discover_targets
    from trajstore.store import Store
    from trajstore.store.ingest import Ingestor, IngestOutcome

    shutil.rmtree(store, ignore_errors=True)
    forget_caches()
    prof = cProfile.Profile()
    with Store.open(store) as s:
        ing = Ingestor(s.space, s.objs, s.refs)
        prof.enable()
        written = []
        for t in discover_targets(cap):
            gated = ing.gate(t)
            if not isinstance(gated, IngestOutcome):
                written.append(ing.write(gated, "bench"))
        s.objs.flush()
        ing.publish_many(written, ing.live_keys())
        prof.disable()
    shutil.rmtree(store, ignore_errors=True)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="top N, one thread")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    if not args.capture.is_dir():
        raise SystemExit(f"{args.capture}: not a directory")
    phases, fsyncs = instrument()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        store = Path(tmp) / "store"
        one_run(args.capture, store, phases, fsyncs)  # warm-up: imports, caches
        runs = [one_run(args.capture, store, phases, fsyncs) for _ in range(args.reps)]
        profile = serial_profile(args.capture, store, args.cprofile) if args.cprofile else ""
    logical = sum(p.stat().st_size for p in args.capture.rglob("*") if p.is_file())
    bundles = len(list(args.capture.rglob("manifest.json")))
    doc = {
        "capture": str(args.capture),
        "bundles": bundles,
        "logical_bytes": logical,
        "load": round(os.getloadavg()[0], 2),
        "runs": runs,
    }
    print(json.dumps(doc, indent=1))
    if profile:
        print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
