"""The copy roofline: the best copy shader's read + write bandwidth on this device, the
ceiling every bandwidth row is divided by (``roofline_fraction``).

Both copy variants (shaders/copy.comp: copy_vec4, copy_scalar) copy one device-local
buffer into another, ≥ 1 GiB on a GPU (well past any L2) and 64 MiB on a software driver
(which finishes in seconds); GPU time from timestamps, wall time where the driver has
none. ``bytes_per_s`` = 2 × bytes / time (each byte read once and written once). Measured
once per device and process: every benchmark of one kvdict-bench run divides by the same
number, and the standalone benchmarks measure it too.
"""
from __future__ import annotations

from . import timing, traffic

GPU_BYTES = 1 << 30
CPU_BYTES = 64 << 20
VARIANTS = ("copy_vec4", "copy_scalar")
_MEASURED: dict = {}  # device index → the roofline


def size_for(dev) -> int:
    """Bytes to copy on ``dev``: GPU_BYTES on a GPU, CPU_BYTES on a software driver, within
    what one buffer may bind and the heap may hold (two buffers), in whole vec4s."""
    from kvdict_vk.vk.submit import device_kind
    want = GPU_BYTES if device_kind(dev) == "gpu" else CPU_BYTES
    lim = dev.info.limits
    cap = min(lim["max_storage_buffer_range"], lim["max_memory_allocation_size"] or 1 << 62,
              dev.info.device_local_bytes // 4)
    return min(want, cap) // 16 * 16


def measure(dev, *, repeats: int | None = None, n_bytes: int | None = None) -> dict:
    """{"bytes", "bytes_per_s", "kernel", "timing" ("gpu"/"wall"), "gpu_s", "wall_s",
    "variants": {kernel: timing}}; remembered per device unless ``n_bytes`` is given."""
    from kvdict_vk.vk.submit import device_kind
    key = dev.info.index
    if n_bytes is None and key in _MEASURED:
        return _MEASURED[key]
    n_bytes = size_for(dev) if n_bytes is None else n_bytes // 16 * 16
    repeats = repeats or (20 if device_kind(dev) == "gpu" else 5)
    variants = _time_variants(dev, n_bytes // 4, repeats)
    basis = "gpu" if all(t["gpu_s"] is not None for t in variants.values()) else "wall"
    moved = traffic.bytes_moved("copy", n_words=n_bytes // 4)["total"]
    best = min(variants, key=lambda v: variants[v][f"{basis}_s"])
    t = variants[best]
    result = {"bytes": n_bytes, "bytes_moved": moved, "bytes_per_s": moved / t[f"{basis}_s"], "kernel": best,
              "timing": basis, "gpu_s": t["gpu_s"], "wall_s": t["wall_s"], "repeats": repeats,
              "variants": variants}
    if basis == "wall":
        result["note"] = timing.NO_TIMESTAMPS
    if n_bytes == size_for(dev):
        _MEASURED[key] = result
    return result


def _time_variants(dev, n_words: int, repeats: int) -> dict:
    from kvdict_vk.vk.kernels import Buffer, Kernel
    from kvdict_vk.vk.submit import Recording
    src = Buffer(dev, n_words, "storage", "roofline source")
    dst = Buffer(dev, n_words, "storage", "roofline destination")
    kernels, recs = [], {}
    try:
        for variant in VARIANTS:
            kernels.append(Kernel(dev, variant, [src, dst], max_items=n_words))
            recs[variant] = Recording(dev, [kernels[-1].op(src_word=0, dst_word=0, n_words=n_words)],
                                      timestamps=True, what=f"roofline {variant}")
            recs[variant].run()  # warm-up: pipeline, first touch of the pages
        return timing.measure(recs, repeats, warm_s=timing.warm_for(dev))
    finally:
        for rec in recs.values():
            rec.free()
        for kernel in kernels:
            kernel.destroy()
        dst.destroy()
        src.destroy()


def fraction(bytes_moved: int | None, t: dict, roofline: dict | None) -> float | None:
    """bytes_moved / time ÷ the roofline's bytes/s, timed the way the roofline was: GPU time
    — the core ops' (``kernel_s``: an attention's passes, without the query's and output's
    copies; the time the SDPA ratio uses) where the timing has it, else the whole
    recording's (``gpu_s``) — or wall time where the device has no timestamps; None when a
    side is missing."""
    if not roofline or bytes_moved is None:
        return None
    if roofline["timing"] == "gpu":
        seconds = t.get("kernel_s") or t.get("gpu_s")
    else:
        seconds = t.get(f"{roofline['timing']}_s")
    if not seconds:
        return None
    return bytes_moved / seconds / roofline["bytes_per_s"]
