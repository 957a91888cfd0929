#!/usr/bin/env python
"""What native code for the gate's reads and a faster chunk codec would buy ingest.

    .venv/bin/python scripts/bench/ingest_ceiling.py [--quick] [--reps 3] [--parts] [--workdir DIR]

An experiment for issue 15, not the product path. Its routed-run target (ingest at least
1.0x a FastCDC-16k + BLAKE3 + zstd-3 pipeline over the same files) is missed, and the
profiles put most of ingest's CPU in per-byte C work: sha256 of every payload (the
integrity gate), zstd-3 of every new window, BLAKE3 of every window, the reads. This
script measures two changes that attack the biggest of them, each in a fresh process
alternating with the baseline on the same files:

- `native`: each payload is read and sha256-hashed by one C call that releases the GIL
  once and hashes every 1 MiB piece right after reading it, while it is in the CPU cache
  (a prototype compiled here with gcc against OpenSSL; trajstore does not ship it);
- `zstd-1`: windows compressed at zstd level -1 instead of 3 (no entropy coding: about
  5x faster on route windows, which zstd-3 shrinks only to ~0.88; more bytes stored);
- `both`.

Everything else is the product's ingest (`Store.open` + `ingest`, fsync on, the whole
gate, + close into a new store) on the data `bench_store.py` generates. `--parts` also
splits an as-is ingest's CPU between those per-byte parts and the rest, with thread-CPU
timers around the functions that do them. Needs gcc, Python's headers and OpenSSL's
(`apt-get install gcc libssl-dev`); exits 2 without them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import stat
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import bench_fastcdc, files_of, generate  # noqa: E402

CONFIGS = ("as-is", "native", "zstd-1", "both")
#: what `--parts` times (thread CPU, all threads) in an as-is ingest
PARTS = ("sha256", "zstd", "BLAKE3 of windows", "reads", "BLAKE3 of new objects")

#: read(2) a whole file in 1 MiB pieces, sha256 of each piece right after it is read, the
#: GIL released once: (bytes, hex digest), or None when the file is not `size` bytes.
C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <errno.h>
#include <unistd.h>

static PyObject *read_sha256(PyObject *self, PyObject *args) {
    int fd; Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "in", &fd, &size)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (!out) return NULL;
    char *buf = PyBytes_AS_STRING(out);
    unsigned char md[EVP_MAX_MD_SIZE]; unsigned int mdlen = 0;
    Py_ssize_t off = 0; int err = 0, ok = 1; char extra;
    Py_BEGIN_ALLOW_THREADS
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || !EVP_DigestInit_ex(ctx, EVP_sha256(), NULL)) ok = 0;
    while (ok && off < size) {
        Py_ssize_t want = size - off < (1 << 20) ? size - off : (1 << 20);
        ssize_t n = read(fd, buf + off, want);
        if (n < 0) { if (errno == EINTR) continue; err = errno; break; }
        if (n == 0) break;
        if (!EVP_DigestUpdate(ctx, buf + off, n)) ok = 0;
        off += n;
    }
    if (ok && !err && off == size) {
        if (read(fd, &extra, 1) != 0) off = -1;
        if (!EVP_DigestFinal_ex(ctx, md, &mdlen)) ok = 0;
    }
    EVP_MD_CTX_free(ctx);
    Py_END_ALLOW_THREADS
    if (err) { Py_DECREF(out); errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    if (!ok) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL sha256 failed");
        return NULL;
    }
    if (off != size) { Py_DECREF(out); Py_RETURN_NONE; }
    char hex[2 * EVP_MAX_MD_SIZE + 1];
    for (unsigned i = 0; i < mdlen; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return Py_BuildValue("(Ns)", out, hex);
}

static PyMethodDef methods[] = {
    {"read_sha256", read_sha256, METH_VARARGS, "read a file descriptor whole, sha256 it"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ceiling_io", NULL, -1, methods};
PyMODINIT_FUNC PyInit__ceiling_io(void) { return PyModule_Create(&module); }
"""


def build_extension(into: Path) -> None:
    """Compile the prototype into `into`; exit 2 with the reason when it cannot."""
    src = into / "_ceiling_io.c"
    src.write_text(C_SOURCE)
    out = into / f"_ceiling_io{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    cmd = ["gcc", "-O2", "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(out), "-lcrypto"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        _fail("needs gcc to build the prototype (apt-get install gcc libssl-dev)")
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["(no output)"])[0]
        _fail(f"building the prototype failed: {first}")


def _fail(why: str) -> NoReturn:
    print(f"ingest_ceiling: {why}", file=sys.stderr)
    raise SystemExit(2)


def _use_native_reads(ext_dir: Path) -> None:
    """Replace the gate's payload read + sha256 with the prototype's one C call; anything
    unusual (not a regular file of the declared size) goes to the product's path."""
    sys.path.insert(0, str(ext_dir))
    import _ceiling_io

    from trajstore.bundle import reader
    from trajstore.errors import BundleError

    product = reader.Bundle._read_verified

    def read_verified(self: reader.Bundle, name: str) -> bytes:
        reader.check_payload_name(name)
        spec = self.manifest.payloads[name]
        path = self.path / "payloads" / f"{name}.pt"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return product(self, name)
        try:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and st.st_size == spec.bytes):
                return product(self, name)
            got = _ceiling_io.read_sha256(fd, spec.bytes)
        finally:
            os.close(fd)
        if got is None:
            return product(self, name)
        data, digest = got
        if digest != spec.sha256:
            raise BundleError(
                f"payload '{name}': sha256 mismatch (file {digest[:12]}…, manifest "
                f"{spec.sha256[:12]}…)"
            )
        return data

    reader.Bundle._read_verified = read_verified


def _time_parts() -> dict[str, float]:
    """Wrap the per-byte C work of ingest in thread-CPU timers: {part: seconds}, filled
    as ingest runs (all threads)."""
    from trajstore.bundle import reader
    from trajstore.cas import array_write, objects

    spent: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    lock = threading.Lock()

    def timed(part: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                with lock:
                    spent[part] += time.thread_time() - t

        return run

    reader.sha256_bytes = timed("sha256", reader.sha256_bytes)
    reader.read_regular = timed("reads", reader.read_regular)
    array_write.encode_chunk = timed("zstd", array_write.encode_chunk)
    array_write.blake3 = timed("BLAKE3 of windows", array_write.blake3)
    objects.object_hash = timed("BLAKE3 of new objects", objects.object_hash)
    return spent


def worker(config: str, cap: Path, store_dir: Path, ext_dir: Path) -> None:
    """One ingest in this (fresh) process under `config`; prints a JSON line."""
    from trajstore.cas import chunk_codec

    spent = _time_parts() if config == "parts" else {}
    if config in ("native", "both"):
        _use_native_reads(ext_dir)
    if config in ("zstd-1", "both"):
        chunk_codec.ZSTD_LEVEL = -1  # read when each thread's compressor is made, and per record
    from trajstore.store import Store
    from trajstore.store.maintenance import stats

    shutil.rmtree(store_dir, ignore_errors=True)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with Store.open(store_dir) as store:
        outs = store.ingest([cap], run="bench")
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    refused = [o for o in outs if o.status == "refused"]
    if refused:
        raise SystemExit(f"refused: {refused[0].path}: {refused[0].reason}")
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    with Store.open(store_dir) as store:
        physical = stats(store)["physical_bytes"]
    print(json.dumps({"wall": wall, "cpu": cpu, "physical": physical, "parts": spent}))


def run_worker(config: str, cap: Path, store_dir: Path, ext_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", config, str(cap), str(store_dir), str(ext_dir)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        _fail(f"the {config} ingest failed (exit {res.returncode}): {last}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(cap: Path, tmp: Path, ext_dir: Path, reps: int) -> dict[str, dict]:
    """Per config: ratios to the baseline run just before it, walls, CPUs, physical bytes."""
    res: dict[str, dict] = {c: {"ratio": [], "wall": [], "cpu": []} for c in CONFIGS}
    res["fastcdc"] = {"wall": [], "cpu": []}
    for rep in range(reps):
        order = CONFIGS if rep % 2 == 0 else tuple(reversed(CONFIGS))
        for config in order:
            c0 = time.process_time()
            _, t_cdc = bench_fastcdc(cap)
            res["fastcdc"]["wall"].append(t_cdc)
            res["fastcdc"]["cpu"].append(time.process_time() - c0)
            got = run_worker(config, cap, tmp / "store", ext_dir)
            res[config]["ratio"].append(t_cdc / got["wall"])
            res[config]["wall"].append(got["wall"])
            res[config]["cpu"].append(got["cpu"])
            res[config]["physical"] = got["physical"]
    return res


def report(title: str, cap: Path, res: dict[str, dict]) -> None:
    logical = sum(p.stat().st_size for p in files_of(cap))
    print(f"\n{title}: {logical / 1e6:.1f} MB of bundle files")
    print(
        "\n| ingest | vs FastCDC (median) | wall s (median) | CPU s (median) | physical/logical |"
    )
    print("|---|---:|---:|---:|---:|")
    for c in CONFIGS:
        r = res[c]
        print(
            f"| {c} | {statistics.median(r['ratio']):.3f}x | {statistics.median(r['wall']):.2f} "
            f"| {statistics.median(r['cpu']):.2f} | {r['physical'] / logical:.3f} |"
        )
    f = res["fastcdc"]
    print(
        f"\nFastCDC-16k + BLAKE3 + zstd-3 (run before each ingest): wall s median "
        f"{statistics.median(f['wall']):.2f}, CPU s median {statistics.median(f['cpu']):.2f}"
    )


def report_parts(cap: Path, tmp: Path, reps: int) -> None:
    """Where an as-is ingest's CPU goes: the timed parts and the rest, medians of `reps`."""
    runs = [run_worker("parts", cap, tmp / "store", tmp) for _ in range(reps)]
    print(f"\nas-is ingest, CPU s by part (thread CPU, all threads; medians of {reps} runs):")
    for part in PARTS:
        print(f"- {part}: {statistics.median(r['parts'][part] for r in runs):.2f}")
    rest = statistics.median(r["cpu"] - sum(r["parts"].values()) for r in runs)
    print(f"- the rest: {rest:.2f} (of {statistics.median(r['cpu'] for r in runs):.2f} in all)")


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="rounds of the four configs")
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    ap.add_argument("--no-small", action="store_true", help="only the routed long run")
    ap.add_argument("--parts", action="store_true", help="also split the routed ingest's CPU")
    ap.add_argument("--workdir", type=Path, help="temp files under this directory")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    routed = ["--rollouts", "6", "--steps", "4", "--samples", "128"]
    small = ["--rollouts", "9", "--steps", "4", "--samples", "80", "--seed", "2"]
    if args.quick:
        routed = ["--rollouts", "2", "--steps", "4", "--samples", "32"]
        small = ["--rollouts", "9", "--steps", "4", "--samples", "16", "--seed", "2"]
        args.reps = min(args.reps, 2)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp_name:
        tmp = Path(tmp_name)
        build_extension(tmp)
        cap = tmp / "routed"
        generate(cap, [*routed, "--routes", "--resumed", "0.1", "--seed", "1"])
        report("Routed long run", cap, measure(cap, tmp, tmp, args.reps))
        if args.parts:
            report_parts(cap, tmp, args.reps)
        shutil.rmtree(cap)
        if not args.no_small:
            cap = tmp / "small"
            generate(cap, small)
            report("Small bundles", cap, measure(cap, tmp, tmp, args.reps))
    print(f"\nload (1 min) {load0:.2f} -> {os.getloadavg()[0]:.2f}; {args.reps} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
