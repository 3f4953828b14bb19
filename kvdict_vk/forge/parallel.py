"""Learning in worker processes: one (layer, stream) per task.

OMP is half BLAS (one GEMM per step, already multi-threaded) and half single-threaded
NumPy; two single-threaded workers keep both cores busy all the time instead. Each
worker limits its OpenBLAS to one thread (via the library's own setter, found in the
process's memory map — the same thing threadpoolctl does), so two workers don't run
four threads on two cores.
"""
from __future__ import annotations

import contextlib
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
