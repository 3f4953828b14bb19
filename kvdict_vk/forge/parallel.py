"""Learning in worker processes: one (layer, stream) per task.

OMP is half BLAS (one GEMM per step, already multi-threaded) and half single-threaded
NumPy; two single-threaded workers keep both cores busy all the time instead. Each
worker limits its OpenBLAS to one thread (via the library's own setter, found in the
process's memory map — the same thing threadpoolctl does), so two workers don't run
four threads on two cores, and every reduction runs in one order whatever the core count.
The workers are fresh interpreters (forge.blas_worker) whose OpenBLAS loads one fixed
kernel set (learning_core), so the bytes learned do not depend on the machine's CPU either.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import re
import pickle
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")


def limit_blas_threads(n: int) -> bool:
    """Best effort: set the thread count of every OpenBLAS loaded in this process."""
    try:
        with open("/proc/self/maps") as f:
            libs = set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read()))
    except OSError:
        return False
    done = False
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                done = True
                break
    return done


_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


def _blas_libs():
    try:
        with open("/proc/self/maps") as f:
            return sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    except OSError:
        return []


def blas_thread_count() -> int | None:
    """The thread count of the first OpenBLAS loaded in this process (None: none found)."""
    for path in _blas_libs():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _GETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn())
    return None


@contextlib.contextmanager
def blas_threads(n: int):
    """OpenBLAS at n threads inside the block, restored afterwards."""
    before = blas_thread_count()
    limit_blas_threads(n)
    try:
        yield
    finally:
        if before is not None:
            limit_blas_threads(before)


# OpenBLAS built with DYNAMIC_ARCH (numpy's wheels) picks its kernels by CPU at load time,
# and kernel sets round differently: the same calibration vectors learned different atoms
# under the Haswell and Sandybridge kernels on one machine (measured; OMP's discrete choices
# amplify the last bits). So learning runs in processes started with OPENBLAS_CORETYPE set
# to one kernel set — Haswell (AVX2 + FMA: every x86-64 of the last decade) by default —
# and the bytes no longer depend on the machine. KVDICT_FORGE_BLAS_CORE names another set,
# or "native" for the machine's own (faster on some CPUs, not reproducible across them).
BLAS_CORE_ENV = "KVDICT_FORGE_BLAS_CORE"
DEFAULT_BLAS_CORE = "Haswell"
_CORE_NEEDS = {"Haswell": ("avx2", "fma"), "Sandybridge": ("avx",)}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def learning_core() -> str | None:
    """The OpenBLAS kernel set learning runs on (None: the machine's own — asked for, or
    the CPU cannot run the default's instructions)."""
    want = os.environ.get(BLAS_CORE_ENV, "").strip() or DEFAULT_BLAS_CORE
    if want.lower() == "native":
        return None
    needs = _CORE_NEEDS.get(want, ())
    return want if set(needs) <= cpu_flags() else None


def workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), int(os.environ.get("KVDICT_FORGE_WORKERS", "2"))))


def map_tasks(fn, tasks: list, progress=None) -> list:
    """[fn(*t) for t in tasks], in worker processes started with OpenBLAS on learning_core()'s
    kernels (spawned: the kernels are chosen when OpenBLAS loads) — or, on the machine's own
    kernels, in this process when one core is allowed, else in forked workers."""
    n, core = workers(), learning_core()
    if core is not None:
        return _run_workers(fn, tasks, progress, n, core)
    if n == 1 or len(tasks) < 2:
        out = []
        for i, t in enumerate(tasks):
            out.append(fn(*t))
            if progress:
                progress(i)
        return out
    results = [None] * len(tasks)
    with ProcessPoolExecutor(n, mp_context=mp.get_context("fork"), initializer=limit_blas_threads,
                             initargs=(1,)) as pool:
        futures = {pool.submit(fn, *t): i for i, t in enumerate(tasks)}
        for done, fut in enumerate(as_completed(futures)):
            results[futures[fut]] = fut.result()
            if progress:
                progress(done)
    return results


def _run_workers(fn, tasks: list, progress, n: int, core: str) -> list:
    """The tasks in n fresh interpreters (forge.blas_worker) whose OpenBLAS loads ``core``'s
    kernels, every n-th task to each; results in task order."""
    if not tasks:
        return []
    groups = [list(enumerate(tasks))[w::n] for w in range(min(n, len(tasks)))]
    env = {**os.environ, "OPENBLAS_CORETYPE": core}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    def run(group):
        proc = subprocess.run([sys.executable, "-m", "kvdict_vk.forge.blas_worker"], env=env,
                              input=pickle.dumps((fn.__module__, fn.__name__, group)), capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"forge worker exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
        out = pickle.loads(proc.stdout)
        if isinstance(out, tuple) and out and out[0] == "error":
            raise out[1]
        return out
    results, done = [None] * len(tasks), 0
    with ThreadPoolExecutor(len(groups)) as pool:
        for fut in as_completed([pool.submit(run, g) for g in groups]):
            for i, r in fut.result():
                results[i] = r
                if progress:
                    progress(done)
                done += 1
    return results
