#!/usr/bin/env python3
"""GPU OMP encoder (kvdict_vk.vk.encoder) vs the CPU reference codec.encode, vectors per second.

One device, one run, interleaved repeats (machine noise hits every candidate alike);
median, quartiles and min/max per candidate, for a dictionary without and with a residual
stage. Candidates: ``gpu_encode`` (GpuEncoder.encode: upload, dispatches, read-back),
``gpu_encode_into`` (GpuEncoder.encode_into a device buffer: no read-back, the arena's
write path) and ``cpu_codec_encode`` (codec.encode_heads, NumPy). Host timing with
time.perf_counter (device timestamps are unreliable on software drivers). Pipelines are
created (and compiled) before the first timed repeat. Also reported: how often both pick
the same atom set and how often the whole slot is identical.

    .venv/bin/python tools/bench_encode.py [--out out/bench_encode.json]

Writes the JSON and a PNG (same stem) next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench_encode.json"))
    ap.add_argument("--n-kv", type=int, default=3)
    ap.add_argument("--n-tok", type=int, default=1024, help="tokens per KV head per encode call")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-atoms", type=int, default=1024)
    ap.add_argument("--sparsity", type=int, default=8)
    ap.add_argument("--residual-bits", default="0,4", help="one configuration per value")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
    ap.add_argument("--validation", action="store_true", help="keep the Khronos validation layer")
    return ap.parse_args(argv)


def _stats(samples) -> dict:
    a = np.asarray(samples, float)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)),
            "p75": float(np.percentile(a, 75)), "min": float(a.min()), "max": float(a.max()),
            "samples": a.tolist()}


def bench_config(bits: int, args, dev, rng) -> dict:
    from kvdict_vk import codec
    from kvdict_vk.dictionary import StreamDict
    from kvdict_vk.vk.device import kp
    from kvdict_vk.vk.encoder import GpuEncoder
    from kvdict_vk.vk.kernels import Buffer, run
    hd, na, s = args.head_dim, args.n_atoms, args.sparsity
    atoms = rng.standard_normal((na, hd))
    atoms = (atoms / np.linalg.norm(atoms, axis=1, keepdims=True)).astype(np.float32)
    d = StreamDict(atoms, mean=rng.standard_normal(hd).astype(np.float32), sparsity=s, residual_bits=bits,
                   residual_scale=(rng.random(hd) + 0.5).astype(np.float32) if bits else None)
    x = (d.mean + rng.standard_normal((args.n_kv, args.n_tok, hd))).astype(np.float32)
    n = x.shape[0] * x.shape[1]
    t = time.perf_counter()
    enc = GpuEncoder(dev, d)
    dest = Buffer(dev, n * d.slot_words, "storage", "bench destination")
    enc.encode(x[:, :1])
    enc.encode_into(dest, x[:, :1], 0, args.n_tok, 0)  # both pick pipelines exist before timing
    setup = time.perf_counter() - t
    cands = {"gpu_encode": lambda: enc.encode(x),
             "gpu_encode_into": lambda: enc.encode_into(dest, x, 0, args.n_tok, 0),
             "cpu_codec_encode": lambda: codec.encode_heads(x, d)}
    secs = {k: [] for k in cands}
    outs = {}
    for rep in range(args.repeats):
        for name, fn in cands.items():
            t = time.perf_counter()
            outs[name] = fn()
            secs[name].append(time.perf_counter() - t)
        print(f"[bench_encode] b={bits} repeat {rep + 1}: " + ", ".join(
            f"{k} {n / v[-1]:,.0f} vec/s" for k, v in secs.items()), file=sys.stderr)
    gpu, cpu = outs["gpu_encode"], outs["cpu_codec_encode"]
    gi, ci = (np.sort(codec.unpack_codes(a[..., :s])[0], -1) for a in (gpu, cpu))
    rel = lambda slots: float(np.sum((codec.decode_heads(slots, d) - x) ** 2) / np.sum(x.astype(np.float64) ** 2))
    result = {"residual_bits": bits, "slot_words": d.slot_words, "n_vectors": n, "atom_block": enc.atom_block,
              "batch_capacity": enc.capacity, "setup_seconds": setup,
              "same_atom_sets": float((gi == ci).all(-1).mean()),
              "identical_slots": float((gpu == cpu).all(-1).mean()),
              "rel_error": {"gpu": rel(gpu), "cpu": rel(cpu)}}
    for name, v in secs.items():
        result[name] = {"seconds": _stats(v), "vectors_per_s": _stats([n / t for t in v])}
    ratios = [c / g for g, c in zip(secs["gpu_encode"], secs["cpu_codec_encode"])]
    result["gpu_over_cpu_speed"] = _stats(ratios)  # paired per repeat
    dest.destroy()
    enc.free()
    return result


def _plot(result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["gpu_encode", "gpu_encode_into", "cpu_codec_encode"]
    configs = result["configs"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        med = [c[name]["vectors_per_s"]["median"] for c in configs]
        lo = [c[name]["vectors_per_s"]["p25"] for c in configs]
        hi = [c[name]["vectors_per_s"]["p75"] for c in configs]
        pos = np.arange(len(configs)) + (i - 1) * width
        ax.bar(pos, med, width, yerr=[np.subtract(med, lo), np.subtract(hi, med)], capsize=3,
               label=name, color=["#37c", "#6a9", "#c73"][i])
    ax.set_xticks(np.arange(len(configs)),
                  [f"residual {c['residual_bits']} bits" if c["residual_bits"] else "no residual" for c in configs])
    ax.set_ylabel("vectors / s (median, IQR)")
    c = result["config"]
    ax.set_title(f"{result['device']['name']}\nhead_dim {c['head_dim']}, {c['n_atoms']} atoms, s {c['sparsity']}, "
                 f"{c['n_kv']}×{c['n_tok']} vectors per call", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = _args(argv)
    if not args.validation:  # must precede the first Vulkan instance
        os.environ["VK_LOADER_LAYERS_DISABLE"] = "VK_LAYER_KHRONOS_validation"
    from kvdict_vk.vk import get_device
    dev = get_device(args.device)
    rng = np.random.default_rng(0)
    t0 = time.time()
    configs = [bench_config(int(b), args, dev, rng) for b in args.residual_bits.split(",") if b.strip()]
    result = {
        "tool": "tools/bench_encode.py", "argv": sys.argv[1:] if argv is None else argv,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - t0, 1),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                 "platform": platform.platform()},
        "device": dev.info.to_dict(), "validation_layer": bool(args.validation),
        "config": {k: getattr(args, k) for k in ("n_kv", "n_tok", "head_dim", "n_atoms", "sparsity", "repeats")},
        "configs": configs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    _plot(result, png)
    print(f"{dev.name}: head_dim {args.head_dim}, {args.n_atoms} atoms, s {args.sparsity}, "
          f"{args.n_kv}×{args.n_tok} vectors per call, {args.repeats} interleaved repeats")
    for c in configs:
        print(f"  residual bits {c['residual_bits']}: same atom sets {c['same_atom_sets']:.4f}, "
              f"identical slots {c['identical_slots']:.4f}, setup {c['setup_seconds']:.1f} s")
        for name in ("gpu_encode", "gpu_encode_into", "cpu_codec_encode"):
            v = c[name]["vectors_per_s"]
            print(f"    {name:18s} {v['median']:10,.0f} vec/s  [{v['p25']:,.0f}, {v['p75']:,.0f}]")
        r = c["gpu_over_cpu_speed"]
        print(f"    GPU / CPU speed (paired): {r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}]")
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
