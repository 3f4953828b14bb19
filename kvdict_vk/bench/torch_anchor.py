"""The anchors from PyTorch on the same GPU, when torch with CUDA is importable (an
optional benchmark dependency, never an install requirement: imported here, inside
functions):

* SDPA — torch.nn.functional.scaled_dot_product_attention over an f16 cache of the
  attention benchmark's shape. One decode query: q (1, n_heads, 1, head_dim), k/v
  (1, n_kv, n_used, head_dim) f16, grouped-query through ``enable_gqa=True`` where that
  torch has it, else k/v expanded to n_heads with repeat_interleave before the timed
  region. Each call timed by its own pair of CUDA events, the calls queued behind a
  sleep kernel (``torch.cuda._sleep``) long enough for the host to enqueue all of them, so
  the GPU never waits for the host's launches between two events: the figure is the
  kernels' GPU time, as our ``kernel_s`` is. Timed back to back without it, a small decode
  query measures the host's launch rate instead (on the H200, SDPA over 3 × 3 heads d64
  read 52 µs at 8 192 tokens in one run and 27 µs in the next); that figure is kept too
  (``unqueued_seconds``). The median over many calls.
* ``cuda_tiny_kernel_sync_us`` — a one-element add + torch.cuda.synchronize(), wall
  time, median: what a submission round trip is measured against.
* ``torch_copy_bytes_per_s`` — a device-to-device tensor copy of the roofline's size,
  read + write bytes over CUDA-event time: the copy roofline's counterpart.
"""
from __future__ import annotations

import time

from .. import diagnostics

WARMUP = 10
# The L2 flush before each timed call (both sides of the SDPA ratio): a read of this many bytes,
# over 5x the H200's 50 MiB L2. Decode attention reads a layer's cache once per token with the
# other layers' caches and weights passing through between, so its K/V come from memory;
# repeated back to back, a cache smaller than the L2 is read from the L2 instead, which flatters
# both sides (lab/NOTEBOOK.md, "L2 flush").
L2_FLUSH_BYTES = 256 << 20
WARM_S = 0.3  # = timing.WARM_S
# torch.cuda._sleep spins for a number of GPU clock cycles; counting them at 2 GHz (above the
# H200's 1.98 GHz boost) makes a sleep at least as long as asked for on any slower clock.
SLEEP_CYCLES_PER_S = 2e9


def anchor():
    """(torch, None) when torch with CUDA is usable here, else (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not installed ({e})"
    try:
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} sees no CUDA device"
    except Exception as e:  # a broken CUDA runtime must not end the benchmark
        return None, f"torch {torch.__version__}: CUDA unusable ({type(e).__name__}: {e})"
    return torch, None


def describe(torch) -> dict:
    """The anchor's side (kvdict_vk.diagnostics.torch_info: torch, CUDA, the CUDA device) and how
    it is timed."""
    return {**diagnostics.torch_info(torch),
            "timing": "CUDA events around each call, the calls queued behind a sleep kernel, an L2 flush "
                      "(a read of l2_flush_bytes) before each call outside its events, median"}


def decode_inputs(torch, n_kv: int, gqa: int, head_dim: int, n_used: int, batch: int = 1, layers: int = 1):
    """SDPA's f16 operands for one decode query per sequence (seeded): q (batch, n_kv·gqa, 1,
    head_dim) and a list of ``layers`` (K, V) pairs, each (batch, n_kv, n_used, head_dim)."""
    dev, f16 = "cuda", torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, n_kv * gqa, 1, head_dim, device=dev, dtype=f16, generator=gen)
    kv = [tuple(torch.randn(batch, n_kv, n_used, head_dim, device=dev, dtype=f16, generator=gen) for _ in range(2))
          for _ in range(layers)]
    return q, kv


def time_sdpa(torch, n_kv: int, gqa: int, head_dim: int, n_used: int, calls: int = 100, batch: int = 1,
              flush=None) -> dict:
    """{"seconds": median GPU time of a call, "samples", "queued": whether the host stayed
    ahead of the GPU (else "seconds" includes waits for the host), "unqueued_seconds": the
    median timed back to back without a sleep first, "launch_s": the host's time to enqueue
    a call, "gqa": how the groups were expanded}: one decode query per sequence, ``batch``
    sequences of n_used tokens. ``flush`` (an :func:`l2_flush`): enqueued before each call,
    outside its events, so every call finds its K/V in memory, not in the L2 (as a decode
    step does: the other layers' caches and weights pass through between two reads of one
    layer's); None: calls back to back on the same tensors (a cache smaller than the L2 then
    stays there)."""
    F = torch.nn.functional  # imported with torch
    q, [(k, v)] = decode_inputs(torch, n_kv, gqa, head_dim, n_used, batch)
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        kwargs, how = {"enable_gqa": True}, "enable_gqa"
    except TypeError:  # torch < 2.5
        k, v = (x.repeat_interleave(gqa, dim=1) for x in (k, v))
        kwargs, how = {}, "repeat_interleave (outside the timed calls)"

    def call():
        F.scaled_dot_product_attention(q, k, v, **kwargs)

    t = time.perf_counter()
    while time.perf_counter() - t < WARM_S:  # the clocks up, as for our kernels (timing.measure)
        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(WARMUP):  # the host's time to enqueue one call, GPU busy: what a sleep must cover
        if flush is not None:
            flush()
        call()
    launch_s = (time.perf_counter() - t) / WARMUP
    torch.cuda.synchronize()
    unqueued, _ = timed_calls(torch, call, calls, hold_s=0.0, before=flush)
    samples, queued = timed_calls(torch, call, calls, hold_s=2.0 * calls * launch_s + 1e-3, before=flush)
    if not queued and getattr(torch.cuda, "_sleep", None) is not None:  # the host was slower this time
        samples, queued = timed_calls(torch, call, calls, hold_s=8.0 * calls * launch_s + 5e-3, before=flush)
    del q, k, v
    torch.cuda.empty_cache()
    return {"seconds": samples[len(samples) // 2], "samples": samples, "queued": queued,
            "unqueued_seconds": unqueued[len(unqueued) // 2], "launch_s": launch_s, "gqa": how}


def l2_flush(torch, n_bytes: int, write: bool = False):
    """A callable that enqueues a pass over an n_bytes buffer (allocated once, here) — a read
    (a sum: clean lines) or, ``write``, a zeroing (leaving the L2 full of lines still to be
    written back) — pushing whatever the L2 held out of it; None for n_bytes 0."""
    if n_bytes <= 0:
        return None
    buf = torch.ones(n_bytes // 4, dtype=torch.float32, device="cuda")
    return buf.zero_ if write else buf.sum


def waited(torch, enqueue):
    """``enqueue`` followed by a wait for the GPU: how torch work is put before a Vulkan
    submission (the two APIs share no queue)."""
    def run():
        enqueue()
        torch.cuda.synchronize()
    return run


def timed_calls(torch, call, calls: int, hold_s: float, before=None) -> tuple[list, bool]:
    """(sorted seconds of each call by its own CUDA events, whether every call was enqueued
    before the GPU reached the first): with ``hold_s`` > 0 the GPU first sleeps that long
    (``torch.cuda._sleep``, where this torch has it), and an event recorded after the sleep
    not yet complete once the last call is enqueued shows the host stayed ahead.
    ``before()``, where given, is enqueued ahead of each call, outside its events."""
    sleep = getattr(torch.cuda, "_sleep", None) if hold_s > 0 else None
    held = None
    if sleep is not None:
        sleep(int(hold_s * SLEEP_CYCLES_PER_S))
        held = torch.cuda.Event()
        held.record()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        call()
        end.record()
    queued = held is not None and not held.query()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) * 1e-3 for start, end in events), queued  # ms → s


def cuda_tiny_kernel_sync_s(torch, calls: int = 1000) -> float:
    x = torch.zeros(1, device="cuda")
    samples = []
    for i in range(WARMUP + calls):
        t = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        if i >= WARMUP:
            samples.append(time.perf_counter() - t)
    return sorted(samples)[len(samples) // 2]


def copy_seconds(torch, n_bytes: int, calls: int = 20) -> float:
    """Median CUDA-event time of one device-to-device copy of n_bytes."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    samples = sorted(start.elapsed_time(end) * 1e-3 for start, end in events)
    del src, dst
    torch.cuda.empty_cache()
    return samples[len(samples) // 2]


def device_anchors(n_bytes: int) -> dict:
    """summary.json's ``anchors``: the CUDA round trip and device copy (None, with a note,
    without torch + CUDA or when they fail)."""
    torch, note = anchor()
    out = {"available": torch is not None, "note": note, "info": describe(torch) if torch else None,
           "cuda_tiny_kernel_sync_us": None, "torch_copy_bytes": n_bytes, "torch_copy_bytes_per_s": None}
    if torch is None:
        return out
    try:
        out["cuda_tiny_kernel_sync_us"] = 1e6 * cuda_tiny_kernel_sync_s(torch)
        out["torch_copy_bytes_per_s"] = 2 * n_bytes / copy_seconds(torch, n_bytes)
    except Exception as e:  # optional: a failure is a note, not a failed run
        out["note"] = f"{type(e).__name__}: {e}"
    return out


class Anchor:
    """The SDPA column of one attention benchmark run: ``seconds(shape...)`` or None, and why."""

    def __init__(self, calls: int = 100, enabled: bool = True, flush_bytes: int = L2_FLUSH_BYTES):
        self.calls = calls
        self.torch, self.note = anchor() if enabled else (None, "not asked for (--no-sdpa)")
        self.info = describe(self.torch) if self.torch is not None else None
        if self.info is not None:
            self.info["l2_flush_bytes"] = flush_bytes
        self.results: dict = {}
        self._flush = l2_flush(self.torch, flush_bytes) if self.torch is not None else None
        # run before each of our timed calls, so they meet the L2 as SDPA's do; None without
        # torch or with flush_bytes 0 (every side back to back)
        self.l2_flush = waited(self.torch, self._flush) if self._flush is not None else None

    def seconds(self, n_kv: int, gqa: int, head_dim: int, n_used: int, batch: int = 1) -> float | None:
        if self.torch is None:
            return None
        key = (n_kv, gqa, head_dim, n_used, batch)
        if key not in self.results:
            try:
                self.results[key] = time_sdpa(self.torch, n_kv, gqa, head_dim, n_used, self.calls, batch,
                                              flush=self._flush)
                if not self.results[key]["queued"]:  # a figure that may include waits for the host
                    self.note = (f"SDPA at {key}: the calls could not be queued ahead of the GPU (no "
                                 f"torch.cuda._sleep, or the host fell behind): its time includes launch waits")
            except Exception as e:  # the anchor is optional: a failure is a note, not a failed run
                self.results[key] = {"seconds": None, "error": f"{type(e).__name__}: {e}"}
                self.note = f"SDPA failed at {key}: {type(e).__name__}: {e}"
        return self.results[key]["seconds"]

    def to_dict(self) -> dict:
        return {"available": self.torch is not None, "note": self.note, "info": self.info,
                "cases": [{"n_kv": k[0], "gqa": k[1], "head_dim": k[2], "n_used": k[3], "batch": k[4], **{
                    x: y for x, y in r.items() if x != "samples"}} for k, r in self.results.items()]}
