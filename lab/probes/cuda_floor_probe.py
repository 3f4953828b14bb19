"""Probe: what the anchor's side pays per kernel on the same GPU — the CUDA counterpart of
attend_floor_probe's empty dispatch. CUDA events around a one-element kernel (one, and two
back to back), enqueued ahead of the GPU as the SDPA anchor's calls are
(bench.torch_anchor.timed_calls); then torch SDPA over an f16 cache at each shape, timed as
the attention benchmark times it (256 MiB read before every call), and its kernels as the
profiler saw them (name, start and end on the GPU, µs) for the last calls. One JSON object
to stdout.

    . .bundle/env.sh && python3 lab/probes/cuda_floor_probe.py --shapes 8x4x64,3x3x64 --n-used 32768

Run as ``python lab/probes/cuda_floor_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import sys

from kvdict_vk.bench import common, torch_anchor as T


def tiny_kernels_s(torch, kernels: int, calls: int) -> float:
    """Median GPU seconds between CUDA events around ``kernels`` one-element adds."""
    x = torch.zeros(1, device="cuda")

    def call():
        for _ in range(kernels):
            x.add_(1.0)
    for _ in range(100):
        call()
    torch.cuda.synchronize()
    samples, _ = T.timed_calls(torch, call, calls, hold_s=0.05)
    return samples[len(samples) // 2]


def launch_args(prof) -> dict:
    """Each kernel's launch as the profiler's trace reports it (grid, block, registers per
    thread, shared memory, blocks and warps per SM, estimated occupancy), by kernel name."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    return {e["name"][:120]: e.get("args", {}) for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"}


def sdpa_kernels(torch, n_kv: int, gqa: int, hd: int, n_used: int, flush, calls: int = 5) -> list:
    """The launches of SDPA's kernels (launch_args), then the CUDA kernels of the last
    ``calls`` SDPA calls (each after a flush), as the profiler records them: per call
    [{name, start_us, end_us}] relative to the call's first kernel."""
    from torch.profiler import ProfilerActivity, profile, record_function
    F = torch.nn.functional
    q, [(k, v)] = T.decode_inputs(torch, n_kv, gqa, hd, n_used)
    for _ in range(20):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(calls):
            flush()
            torch.cuda.synchronize()
            with record_function(f"sdpa_call_{i}"):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if str(getattr(e, "device_type", "")).endswith("CUDA")), key=lambda t: t[0])
    # a call's kernels: those after the flush's reduction (the flush is the kernel named *reduce*)
    per_call, cur = [], None
    for start, end, name in kernels:
        if "reduce" in name.lower() and "flash" not in name.lower():
            cur = []
            per_call.append(cur)
        elif cur is not None:
            cur.append((start, end, name))
    out = [launch_args(prof)]
    for ks in per_call:
        if ks:
            t0 = ks[0][0]
            out.append([{"name": n[:120], "start_us": round(s - t0, 3), "end_us": round(e - t0, 3)} for s, e, n in ks])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x4x64,3x3x64", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="32768,131072")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--l2-flush-mib", type=int, default=256)
    a = ap.parse_args(argv)
    import torch
    flush = T.l2_flush(torch, a.l2_flush_mib << 20)
    out = {"argv": sys.argv, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "l2_flush_mib": a.l2_flush_mib,
           "one_tiny_kernel_s": tiny_kernels_s(torch, 1, a.calls),
           "two_tiny_kernels_s": tiny_kernels_s(torch, 2, a.calls), "sdpa": []}
    print(json.dumps({k: out[k] for k in ("one_tiny_kernel_s", "two_tiny_kernels_s")}), file=sys.stderr)
    for shape in a.shapes.split(","):
        n_kv, gqa, hd = common.dims(shape)
        for n in (int(x) for x in a.n_used.split(",")):
            timed = T.time_sdpa(torch, n_kv, gqa, hd, n, calls=a.calls, flush=flush)
            case = {"shape": shape, "n_used": n, "seconds": timed["seconds"], "queued": timed["queued"],
                    "kernels": sdpa_kernels(torch, n_kv, gqa, hd, n, flush)}
            out["sdpa"].append(case)
            print(json.dumps({k: case[k] for k in ("shape", "n_used", "seconds")}), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
