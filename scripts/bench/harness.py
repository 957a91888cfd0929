"""What every benchmark shares: the stamp, timing, the figures contract and the baselines.

Imported by `run.py` (`make bench`) and by each figure script in this directory (they run
from here: `sys.path` holds this folder); never by the library.

- **Stamp**: `load1()` (1-minute load average), `machine()` (cores, CPU, Python, torch,
  NumPy), `drop_caches()` (page cache, for cold figures; needs root).
- **Timing**: `repeat(fn, n)` (wall seconds of `n` calls), `median`, `pct`, `spread`.
- **Figures contract**: a script reports `{"figures": [...], "command", "load", "machine"}`
  through `emit`; a figure is `figure(name, target, value, unit, ...)`: `reps` (its values
  over the script's own repetitions), `exact` (bytes: the same every run), `workload` and
  `target_workload` (the size measured, the size the target names; `workload_unit` names
  it), `detail` (what it compares). `check_document` says what is wrong with a document.
  A script's own `met` is informational: the verdict is decided by
  scripts/bench/verdicts.py (`Result.verdict`).
- **Running**: `run_script` runs one figure script as a subprocess in its own session (a
  timeout also ends the servers and workers it started) and never raises for what it does.
- **Baselines**: Hugging Face Xet's local CAS (`run_xet`, issue 33), plus the helpers the
  ingest figures share (`isolate`, `forget_trajstore_caches`, `tree_bytes`, `files_under`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verdicts import NOT_MEASURED, Target, Verdict, decide

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- stamp


def say(msg: str) -> None:
    print(msg, flush=True)


def load1() -> float:
    """The 1-minute load average, rounded."""
    return round(os.getloadavg()[0], 2)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> dict[str, str]:
    """Cores, CPU, Python and (when importable) torch and NumPy versions."""
    out = {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": cpu_model(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(ImportError):
        import numpy

        out["numpy"] = numpy.__version__
    if "torch" in sys.modules:  # never import torch just for the stamp
        torch = sys.modules["torch"]
        out["torch"] = f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)"
    return out


def machine_line(m: dict[str, str] | None = None) -> str:
    m = m or machine()
    rest = ", ".join(f"{k} {v}" for k, v in m.items() if k not in ("nproc", "cpu"))
    return f"`nproc` {m['nproc']}, {m['cpu']}, {rest}"


def drop_caches() -> None:
    """Empty the page cache so the next read comes from the disk (needs root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"cannot drop the page cache ({e}); run as root, or warm") from None


# --------------------------------------------------------------------------- timing


def repeat(fn: Callable[[], Any], n: int) -> list[float]:
    """Wall seconds of each of `n` calls of `fn`."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def pct(xs: Sequence[float], q: float) -> float:
    """The `q` quantile (0-1) of `xs`, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def spread(xs: Sequence[float]) -> str:
    """`lo-hi` of the repetitions, as a table shows it."""
    return f"{min(xs):.2f}-{max(xs):.2f}"


# --------------------------------------------------------------------------- figures contract

FIGURE_KEYS = {"name": str, "target": str, "value": (int, float), "unit": str, "met": bool}


def figure(
    name: str,
    target: str,
    value: float,
    unit: str,
    *,
    reps: Sequence[float] | None = None,
    exact: bool = False,
    workload: float | None = None,
    target_workload: float | None = None,
    workload_unit: str = "",
    detail: str = "",
) -> dict[str, Any]:
    """One figure of the contract; `met` is the script's own reading (the verdict is the
    runner's, from verdicts.py)."""
    m = re.match(r"\s*(<=|>=)\s*([\d.,]+)", target)
    met = False
    if m is not None:
        met = Target(float(m[2].replace(",", "")), m[1]).holds(value)
        if target_workload is not None:
            met = met and workload is not None and workload >= target_workload
    out: dict[str, Any] = {
        "name": name,
        "target": target,
        "value": round(float(value), 4),
        "unit": unit,
        "met": met,
        "detail": detail,
    }
    if reps is not None:
        out["reps"] = [round(float(x), 4) for x in reps]
    if exact:
        out["exact"] = True
    if workload is not None:
        out["workload"] = workload
    if target_workload is not None:
        out["target_workload"] = target_workload
    if workload_unit:
        out["workload_unit"] = workload_unit
    return out


def capture_figures(
    loop: str, ratio: float, reps: Sequence[float], dropped: int, detail: str, **workload: Any
) -> list[dict[str, Any]]:
    """The two figures of a capture-overhead script: wall time on / off (issue 33's
    <= 1.05x; `workload`: `figure`'s workload keywords, for the ratio) and the bundles
    dropped (none, exactly)."""
    return [
        figure(f"capture overhead, {loop} (on / off)", "<= 1.05x", ratio, "x", reps=reps,
               detail=detail, **workload),
        figure(f"capture, {loop}: bundles dropped", "<= 0", dropped, "", exact=True),
    ]  # fmt: skip


def writer_process_cpu_s() -> float:
    """The CPU seconds the capture writer process (TRAJSTORE_CAPTURE_WRITER=process) has
    used so far, 0 when there is none: the training process's own clocks miss it."""
    from trajstore.capture import writer_process

    shared = writer_process._SHARED
    if shared is None:
        return 0.0
    try:
        fields = Path(f"/proc/{shared.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def start_writer(writer: str) -> float:
    """Select the capture writer for this process; for ``process`` start it now and return
    the seconds that took (once per training process, so outside the timed blocks)."""
    os.environ["TRAJSTORE_CAPTURE_WRITER"] = writer
    if writer != "process":
        return 0.0
    from trajstore.capture import writer_process

    start = time.perf_counter()
    writer_process._shared()
    return time.perf_counter() - start


def emit(
    path: Path | None,
    figures: list[dict[str, Any]],
    load_before: float,
    **extra: Any,
) -> dict[str, Any]:
    """Print the figures and write the script's document to `path` (when given)."""
    doc = {
        "figures": figures,
        "command": shlex.join([".venv/bin/python", *sys.argv]).replace(f"{ROOT}/", ""),
        "load": [load_before, load1()],
        "machine": machine(),
        **extra,
    }
    for f in figures:
        say(f"figure: {f['name']}: {f['value']} {f['unit']} (target {f['target']})")
    if path is not None:
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def check_document(doc: Any) -> list[dict[str, Any]]:
    """The figures of a script's JSON document; ValueError says what is wrong with it."""
    if not isinstance(doc, dict) or not isinstance(doc.get("figures"), list):
        raise ValueError('no "figures" list')
    if not doc["figures"]:
        raise ValueError("an empty figures list")
    for i, f in enumerate(doc["figures"]):
        if not isinstance(f, dict):
            raise ValueError(f"figure {i} is not an object")
        for key, kind in FIGURE_KEYS.items():
            if not isinstance(f.get(key), kind) or (key == "value" and isinstance(f[key], bool)):
                raise ValueError(f"figure {i} ({f.get('name', '?')}): bad or missing {key!r}")
    return doc["figures"]


# --------------------------------------------------------------------------- running


@dataclass
class Result:
    """One run of a figure script: its figures, or why there are none."""

    name: str
    script: str
    command: str
    problem: str | None = None
    figures: list[dict[str, Any]] = field(default_factory=list)
    load: tuple[float | None, float | None] = (None, None)
    seconds: float = 0.0
    #: the later runs of the same script (`--reps`)
    reps: list[Result] = field(default_factory=list)

    def verdict(self, f: dict[str, Any]) -> Verdict:
        """Figure `f`'s verdict over every run of the script (verdicts.decide): each run's
        `reps` when every run has them, else each run's value."""
        m = re.match(r"\s*(<=|>=)\s*([\d.,]+)", f["target"])
        if m is None:
            return Verdict(NOT_MEASURED, f"target {f['target']!r} is not a bound")
        target = Target(
            float(m[2].replace(",", "")),
            m[1],
            workload=f.get("target_workload"),
            workload_unit=f.get("workload_unit", ""),
        )
        same = [g for r in [self, *self.reps] for g in r.figures if g["name"] == f["name"]]
        if all(isinstance(g.get("reps"), list) for g in same):
            values = [float(x) for g in same for x in g["reps"]]
        else:
            values = [float(g["value"]) for g in same]
        sizes = [g.get("workload") for g in same]
        workload = None if None in sizes else min(sizes)
        return decide(values, target, workload=workload, exact=bool(f.get("exact")))


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " / ".join(lines[-n:])[:300]


def run_script(
    name: str,
    script: str,
    args: list[str],
    work: Path,
    timeout: float,
    bench: Path = BENCH,
    python: str = sys.executable,
) -> Result:
    """Run one figure script with `args` and `--json`; never raises for what it does."""
    path = bench / script
    out = work / f"{name}.json"
    log = work / f"{name}.log"
    argv = [python, str(path), *args, "--json", str(out)]
    shown = shlex.join([".venv/bin/python", f"scripts/bench/{script}", *args])
    res = Result(name, script, shown)
    if not path.is_file():
        res.problem = "missing: the script does not exist"
        return res
    out.unlink(missing_ok=True)
    before = load1()
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except BaseException:  # Ctrl-C: end what this script started, then stop
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    res.seconds = time.perf_counter() - t0
    res.load = (before, load1())
    if rc is None:
        res.problem = f"failed: timed out after {timeout:.0f} s"
        return res
    if rc != 0:
        res.problem = f"failed: exit {rc}: {_tail(log) or 'no output'}"
        return res
    try:
        doc = json.loads(out.read_text())
        res.figures = check_document(doc)
    except FileNotFoundError:
        res.problem = "failed: exit 0 but no --json file written"
        return res
    except ValueError as e:  # JSONDecodeError is a ValueError
        res.problem = f"failed: its --json file is not valid: {e}"
        return res
    lo = doc.get("load")
    if isinstance(lo, list) and len(lo) == 2 and all(isinstance(x, (int, float)) for x in lo):
        res.load = (float(lo[0]), float(lo[1]))
    return res


# --------------------------------------------------------------------------- baselines

#: the fields of Xet's `dedup_metrics` a benchmark reports
XET_METRICS = (
    "total_bytes",
    "new_bytes",
    "deduped_bytes",
    "xorb_bytes_uploaded",
    "shard_bytes_uploaded",
    "total_chunks",
    "deduped_chunks",
)


def require_xet() -> None:
    """Exit with a one-line hint when hf_xet is missing (before anything is generated)."""
    try:
        import hf_xet  # noqa: F401
    except ImportError:
        raise SystemExit(
            "hf_xet is not installed: pip install hf_xet (the dev extra has it)"
        ) from None


def isolate(work: Path) -> None:
    """Point Xet's cache into `work` (never the user's cache) and turn telemetry off."""
    os.environ["HF_XET_CACHE"] = str(work / "xet-cache")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


def forget_trajstore_caches() -> None:
    """Empty trajstore's per-process caches (encoded windows, decoded chunks), so an ingest
    repeated in one process costs what `trajstore ingest` costs in a new one."""
    from trajstore.cas.arrays import ENCODE_CACHE
    from trajstore.cas.chunk_cache import CHUNK_CACHE

    ENCODE_CACHE.clear()
    CHUNK_CACHE.clear()


def tree_bytes(root: Path) -> int:
    """Bytes of every regular file under `root` (what it takes on disk, before blocks)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def files_under(root: Path) -> list[Path]:
    """Every regular file under `root`, sorted: what a user would hand Xet for a directory."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def run_xet(files: Iterable[Path], cas: Path) -> dict[str, Any]:
    """Store `files` into a fresh local Xet CAS at `cas` (`XetSession().new_upload_commit(
    endpoint="local://DIR")`, one `start_upload_file(path, sha256=SKIP_SHA256)` per file):
    wall seconds (session to the CAS written), the CAS directory's bytes and Xet's own
    dedup metrics."""
    import hf_xet

    cas.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    session = hf_xet.XetSession()
    commit = session.new_upload_commit(endpoint=f"local://{cas}")
    for path in files:
        commit.start_upload_file(str(path), sha256=hf_xet.SKIP_SHA256)
    report = commit.wait_to_finish()
    wall = time.perf_counter() - start
    m = report.dedup_metrics
    return {
        "wall_s": wall,
        "cas_dir_bytes": tree_bytes(cas),
        "dedup_metrics": {name: getattr(m, name) for name in XET_METRICS},
    }
