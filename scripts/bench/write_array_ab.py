"""write_array old vs new over a capture's payloads: same objects and records, and CPU.

    .venv/bin/python scripts/bench/write_array_ab.py CAPTURE_DIR OLD_REV check
    .venv/bin/python scripts/bench/write_array_ab.py CAPTURE_DIR OLD_REV 7      # 7 interleaved reps
    .venv/bin/python scripts/bench/write_array_ab.py CAPTURE_DIR OLD_REV profnew|profold

CAPTURE_DIR as bench_store.py makes its small bundles:
`python -m trajstore.examples.gen_long_run DIR --rollouts 9 --steps 4 --samples 80 --seed 2`.
OLD_REV's trajstore/cas/arrays.py is loaded beside the current one; each pass writes every
payload as ingest does (same row lengths, heads, delta bases) into a fresh LocalObjectStore
with a cleared encode cache. `check` compares every put (order, name, bytes) and record.
"""

import cProfile
import importlib.util
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import trajstore.cas.arrays as new
from trajstore.bundle.capture_dir import discover_targets
from trajstore.cas.objects import LocalObjectStore, ObjectStore
from trajstore.store.ingest_gate import verify_target
from trajstore.store.ingest_rows import (
    BASE_NAMES,
    DELTA_BASES,
    SampleLayout,
    payload_rows,
    write_order,
)
from trajstore.store.ingest_write import delta_base

ROOT = Path(__file__).resolve().parents[2]

_old_src = Path(tempfile.mkdtemp(prefix="wa_ab")) / "arrays_old.py"
_old_src.write_text(
    subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{sys.argv[2]}:trajstore/cas/arrays.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
)
spec = importlib.util.spec_from_file_location("arrays_old", _old_src)
old = importlib.util.module_from_spec(spec)
sys.modules["arrays_old"] = old
spec.loader.exec_module(old)


def load(root):
    """Every bundle (each rank of a cohort) under `root`, as ingest finds and opens them."""
    out = []
    for r in (r for t in discover_targets(Path(root)) for r in verify_target(t).ranks):
        layout = SampleLayout.of(r.index)
        out.append([payload_rows(p, layout) for p in r.payloads(write_order(r.payload_names))])
    return out


class Rec(ObjectStore):
    """Logs every put (order, name, bytes) over a LocalObjectStore."""

    def __init__(self, inner):
        self.inner = inner
        self.log = []

    def put(self, d):
        h = self.inner.put(d)
        self.log.append((h, bytes(d)))
        return h

    def put_many(self, ds):
        ds = list(ds)
        hs = self.inner.put_many(ds)
        self.log += [(h, bytes(d)) for h, d in zip(hs, ds, strict=True)]
        return hs

    def get(self, h):
        return self.inner.get(h)

    def get_many(self, hs):
        return self.inner.get_many(hs)

    def has(self, h):
        return self.inner.has(h)

    def has_cached(self, h, size):
        return self.inner.has_cached(h, size)

    def iter_objects(self):
        return self.inner.iter_objects()

    def delete(self, h):
        pass

    def delete_many(self, hs):
        pass


def run(mod, bundles, tmp, log=False):
    mod.ENCODE_CACHE.clear()
    inner = LocalObjectStore(Path(tempfile.mkdtemp(dir=tmp)), durable=False)
    objs = Rec(inner) if log else inner
    recs = []
    t0 = time.process_time()
    for items in bundles:
        records, bvals = {}, {}
        for rows in items:
            base = delta_base(records, rows)
            r = mod.write_array(
                objs,
                rows.values,
                rows.lengths,
                dtype_tag=rows.dtype_tag,
                base=base,
                base_values=bvals.get(DELTA_BASES.get(rows.name, "")) if base is not None else None,
                heads=rows.heads,
            )
            records[rows.name] = r
            if rows.name in BASE_NAMES:
                bvals[rows.name] = rows.values
            recs.append(r.to_object())
    cpu = time.process_time() - t0
    return cpu, (objs.log if log else None), recs


if __name__ == "__main__":
    bundles = load(sys.argv[1])
    mode = sys.argv[3]
    tmp = tempfile.mkdtemp(prefix="h6")
    nb = len(bundles)
    if mode == "check":
        _, lo, ro = run(old, bundles, tmp, True)
        _, ln, rn = run(new, bundles, tmp, True)
        print(
            "puts",
            len(lo),
            len(ln),
            "objects equal:",
            lo == ln,
            "records equal:",
            ro == rn,
            "distinct",
            len({h for h, _ in lo}),
        )
    elif mode.startswith("prof"):
        mod = old if mode == "profold" else new
        run(mod, bundles, tmp)
        pr = cProfile.Profile()
        pr.enable()
        run(mod, bundles, tmp)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    else:
        reps = int(mode)
        run(old, bundles, tmp)
        run(new, bundles, tmp)
        o, n = [], []
        for _ in range(reps):
            o.append(run(old, bundles, tmp)[0])
            n.append(run(new, bundles, tmp)[0])
        mo, mn = np.median(o), np.median(n)
        print(
            f"write_array CPU ms/bundle old {1e3 * mo / nb:.2f} new {1e3 * mn / nb:.2f} "
            f"ratio new/old {mn / mo:.3f} (old {[round(x * 1e3 / nb, 2) for x in o]} "
            f"new {[round(x * 1e3 / nb, 2) for x in n]})"
        )
        print("load", os.getloadavg())
