"""Learning in worker processes: one (layer, stream) per task.

OMP is half BLAS (one GEMM per step, already multi-threaded) and half single-threaded
NumPy; two single-threaded workers keep both cores busy all the time instead. Each
worker limits its OpenBLAS to one thread (via the library's own setter, found in the
process's memory map — the same thing threadpoolctl does), so two workers don't run
four threads on two cores.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
from concurrent.futures import ProcessPoolExecutor, as_completed

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


def workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), int(os.environ.get("KVDICT_FORGE_WORKERS", "2"))))


def map_tasks(fn, tasks: list, progress=None) -> list:
    """[fn(*t) for t in tasks], in worker processes when more than one core is allowed."""
    n = workers()
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
