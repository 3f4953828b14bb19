"""Wall and GPU time of benchmark candidates, measured side by side.

A candidate is a :class:`kvdict_vk.vk.submit.Recording` (recorded once; each repeat runs
it again and reads its GPU time from the timestamps after the wall clock stops) or any
callable (host work, or GPU work made of several submissions: wall time only). Repeats
are interleaved (common.interleaved), so machine noise hits every candidate alike.
"""
from __future__ import annotations

import time

from . import common

MIN_REPEATS = 3  # what a time budget may cut the repeats down to
NO_TIMESTAMPS = "the device has no usable timestamps: wall time only"
NOT_RECORDED = "several submissions per call: wall time only"


def is_recording(candidate) -> bool:
    return hasattr(candidate, "gpu_seconds") and hasattr(candidate, "run")


def measure(candidates: dict, repeats: int, after_repeat=None, budget_s: float | None = None) -> dict:
    """{name: timing} for {name: Recording | callable}; see :func:`timing`.
    ``after_repeat(rep, wall_seconds)`` as for common.interleaved. ``budget_s``: one
    untimed round first, and fewer repeats (at least MIN_REPEATS) when ``repeats`` rounds
    of that would take longer — so a slow case cannot stretch a run past its budget."""
    recordings = {n: c for n, c in candidates.items() if is_recording(c)}
    gpu = {n: [] for n in recordings}
    if budget_s is not None:
        t = time.perf_counter()
        for c in candidates.values():
            c.run() if is_recording(c) else c()
        repeats = min(repeats, max(MIN_REPEATS, int(budget_s / max(time.perf_counter() - t, 1e-9))))

    def after(rep, wall):
        for name, rec in recordings.items():  # outside the timed calls
            gpu[name].append(rec.gpu_seconds())
        if after_repeat:
            after_repeat(rep, wall)
    calls = {n: (c.run if n in recordings else c) for n, c in candidates.items()}
    wall, _ = common.interleaved(calls, repeats, after)
    return {n: timing(wall[n], gpu.get(n), recorded=n in recordings) for n in candidates}


def timing(wall, gpu=None, *, recorded: bool = True) -> dict:
    """``wall_s`` / ``gpu_s`` (medians, seconds; gpu_s None without timestamps), their
    statistics, and a note when there is no GPU time."""
    gpu_ok = bool(gpu) and all(g is not None for g in gpu)
    out = {"wall_s": common.stats(wall)["median"], "gpu_s": common.stats(gpu)["median"] if gpu_ok else None,
           "wall": common.stats(wall), "gpu": common.stats(gpu) if gpu_ok else None}
    if not gpu_ok:
        out["note"] = NO_TIMESTAMPS if recorded else NOT_RECORDED
    return out


def best_seconds(t: dict) -> float:
    """The time a figure is quoted at: GPU time when there is one, else wall time."""
    return t["gpu_s"] if t["gpu_s"] is not None else t["wall_s"]
