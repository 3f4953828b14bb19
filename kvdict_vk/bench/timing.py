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


def measure(candidates: dict, repeats: int, after_repeat=None, budget_s: float | None = None,
            warm_s: float = 0.0, before=None) -> dict:
    """{name: timing} for {name: Recording | callable}; see :func:`timing`.
    ``after_repeat(rep, wall_seconds)`` as for common.interleaved. ``budget_s``: one
    untimed round first, and fewer repeats (at least MIN_REPEATS) when ``repeats`` rounds
    of that would take longer — so a slow case cannot stretch a run past its budget.
    ``warm_s``: untimed rounds for that long first — a GPU lowers its clocks within
    milliseconds of idling (the host preparing the case) and raises them only under
    sustained load: an H200 measured 2-5× slower per kernel without this (warm_for).
    ``before()``: called before each timed call, outside its timing (the attention
    benchmarks' L2 flush: torch_anchor.Anchor.l2_flush); a dict: each candidate's own."""
    recordings = {n: c for n, c in candidates.items() if is_recording(c)}
    gpu = {n: [] for n in recordings}
    core = {n: [] for n in recordings}
    t = time.perf_counter()
    while recordings and time.perf_counter() - t < warm_s:  # GPU work only: a callable may be host work
        for rec in recordings.values():
            rec.run()
    if budget_s is not None:
        t = time.perf_counter()
        for c in candidates.values():
            c.run() if is_recording(c) else c()
        repeats = min(repeats, max(MIN_REPEATS, int(budget_s / max(time.perf_counter() - t, 1e-9))))

    def after(rep, wall):
        for name, rec in recordings.items():  # outside the timed calls
            gpu[name].append(rec.gpu_seconds())
            core[name].append(rec.core_seconds() if hasattr(rec, "core_seconds") else None)
        if after_repeat:
            after_repeat(rep, wall)
    calls = {n: (c.run if n in recordings else c) for n, c in candidates.items()}
    wall, _ = common.interleaved(calls, repeats, after, before=before)
    return {n: timing(wall[n], gpu.get(n), recorded=n in recordings, core=core.get(n)) for n in candidates}


# Untimed load before a GPU case is timed (measure's warm_s); CPU drivers need none.
WARM_S = 0.3


def warm_for(device) -> float:
    """measure's warm_s for ``device``: WARM_S on a GPU, 0 on a CPU driver."""
    return 0.0 if device.info.device_type == "cpu" else WARM_S


def timing(wall, gpu=None, *, recorded: bool = True, core=None) -> dict:
    """``wall_s`` / ``gpu_s`` (medians, seconds; gpu_s None without timestamps), their
    statistics, and a note when there is no GPU time. ``core``: GPU seconds of the
    recording's core ops (an attention's passes without the query's and output's copies)
    → ``kernel_s``, None where absent."""
    gpu_ok = bool(gpu) and all(g is not None for g in gpu)
    core_ok = bool(core) and all(c is not None for c in core)
    out = {"wall_s": common.stats(wall)["median"], "gpu_s": common.stats(gpu)["median"] if gpu_ok else None,
           "kernel_s": common.stats(core)["median"] if core_ok else None,
           "wall": common.stats(wall), "gpu": common.stats(gpu) if gpu_ok else None}
    if not gpu_ok:
        out["note"] = NO_TIMESTAMPS if recorded else NOT_RECORDED
    return out


def best_seconds(t: dict) -> float:
    """The time a figure is quoted at: GPU time when there is one, else wall time."""
    return t["gpu_s"] if t["gpu_s"] is not None else t["wall_s"]
