#!/usr/bin/env python3
"""Reconstruct-shader throughput vs. the plain copy shader, the f32 cache read and NumPy.

One device, one run, interleaved repeats (so machine noise hits every candidate alike);
medians, quartiles and the paired copy/reconstruct ratio per repeat. Host timing with
time.perf_counter around Sequence.eval (device timestamps are unreliable on software
drivers); the dispatch is timed without the read-back, which is reported separately.

    .venv/bin/python tools/bench_reconstruct.py [--out out/bench_reconstruct.json]

Writes the JSON and a PNG (same stem) next to it. The goal is reconstruct ≥ 0.7× the copy
shader's bandwidth for the same output bytes.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_attention's helpers
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL = 0.7


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench_reconstruct.json"))
    ap.add_argument("--n-kv", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--n-atoms", type=int, default=1024)
    ap.add_argument("--sparsity", type=int, default=8)
    ap.add_argument("--sweep", default="1,2,4,8,16", help="sparsities for the scaling sweep ('' = none)")
    ap.add_argument("--residual-bits", type=int, default=0, help="residual stage bits per level (0 = none)")
    ap.add_argument("--per-head", action="store_true", help="one dictionary per KV head (default: shared)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
    ap.add_argument("--mapping", choices=["row", "chunk"], default=None,
                    help="shader invocation mapping (default: by device type — row on CPU drivers)")
    ap.add_argument("--validation", action="store_true",
                    help="keep the Khronos validation layer (this kp build enables it whenever installed)")
    return ap.parse_args(argv)


def _stats(samples) -> dict:
    a = np.asarray(samples, float)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)),
            "p75": float(np.percentile(a, 75)), "min": float(a.min()), "max": float(a.max()),
            "samples": a.tolist()}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _setup(s, args, dev, rng):
    """A one-layer dict arena filled with n_ctx tokens of random codes, and the same words
    for NumPy; an f32 arena with the same rows for the baseline read."""
    from kvdict_vk import runtime
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    from kvdict_vk.vk import KvArena
    hd, na, n_kv, n_ctx, bits = args.head_dim, args.n_atoms, args.n_kv, args.n_ctx, args.residual_bits
    g = n_kv if args.per_head else 1
    dicts = [StreamDict(rng.standard_normal((g, na, hd), dtype=np.float32),
                        mean=rng.standard_normal((g, hd), dtype=np.float32), sparsity=s, residual_bits=bits,
                        residual_scale=rng.random((g, hd), dtype=np.float32) + 0.5 if bits else None)
             for _ in "kv"]
    runtime.enable(KvDictArtifact(hd, na, s, ((dicts[0], dicts[1]),)))
    try:
        arena = KvArena(1, n_kv, hd, n_ctx, device=dev, shader_mapping=args.mapping)
    finally:
        runtime.deactivate()
    # random valid slots (reconstruction costs the same whatever the codes say; OMP-encoding
    # 2 × n_kv × n_ctx rows per sparsity would dominate the run)
    from bench_attention import _random_slots
    codes = [_random_slots(rng, d, n_kv, n_ctx) for d in dicts]
    arena.append_codes(0, *codes)
    return arena, codes, dicts


def _copy_sequence(dev, n_words):
    from kvdict_vk.vk.kernels import Buffer, Kernel
    src, dst = Buffer(dev, n_words, "storage", "copy src"), Buffer(dev, n_words, "storage", "copy dst")
    kernel = Kernel(dev, "copy_vec4" if n_words % 4 == 0 else "copy_scalar", [src, dst], max_items=n_words)
    seq = dev.manager.sequence()
    seq.record(kernel.op(src_word=0, dst_word=0, n_words=n_words))
    return seq, (kernel, src, dst)


def bench_sparsity(s, args, dev, rng, *, numpy_too: bool) -> dict:
    from kvdict_vk import codec
    from kvdict_vk.vk import KvArena
    arena, codes, dicts = _setup(s, args, dev, rng)
    plan = arena.read_plan(0, 0, args.n_ctx)
    k, v = plan.run()  # warm-up (pipeline compile) and a correctness check
    ref = codec.decode_heads(codes[0], dicts[0])
    nmse = float(np.sum((ref - k) ** 2) / np.sum(ref ** 2))
    out_bytes = 4 * plan.n_words
    copy_seq, keep = _copy_sequence(dev, plan.n_words)
    copy_seq.eval()
    f32 = KvArena(1, args.n_kv, args.head_dim, args.n_ctx, device=dev, shader_mapping=args.mapping)
    f32.append(0, k, v)
    f32_plan = f32.read_plan(0, 0, args.n_ctx)
    f32_plan.dispatch()
    cand = {"reconstruct": plan.dispatch, "copy_shader": copy_seq.eval, "f32_cache_read": f32_plan.dispatch,
            "readback": plan.readback}
    if numpy_too:
        cand["numpy_reconstruct_f32"] = lambda: [codec.decode_heads(c, d, np.float32)
                                                 for c, d in zip(codes, dicts)]
    times = {name: [] for name in cand}
    for _ in range(args.repeats):
        for name, fn in cand.items():
            times[name].append(_timed(fn))
    vectors = 2 * args.n_kv * args.n_ctx  # head vectors produced per read (K and V)
    res = {"sparsity": s, "shader_mapping": arena.shader_mapping, "output_bytes": out_bytes, "head_vectors": vectors, "nmse_vs_float64": nmse}
    for name, t in times.items():
        st = _stats(t)
        st["output_gb_per_s"] = out_bytes / st["median"] / 1e9
        st["vectors_per_s"] = vectors / st["median"]
        res[name] = st
    paired = np.asarray(times["copy_shader"]) / np.asarray(times["reconstruct"])
    res["ratio_reconstruct_over_copy"] = _stats(paired)
    res["ratio_of_medians"] = res["copy_shader"]["median"] / res["reconstruct"]["median"]
    for x in (arena, f32):
        x.free()
    for x in keep:
        x.destroy()
    return res


def _plot(result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    main, sweep = result["main"], result["sweep"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["copy_shader", "f32_cache_read", "reconstruct", "numpy_reconstruct_f32"]
    names = [n for n in names if n in main]
    med = [main[n]["output_gb_per_s"] for n in names]
    lo = [main["output_bytes"] / main[n]["p75"] / 1e9 for n in names]
    hi = [main["output_bytes"] / main[n]["p25"] / 1e9 for n in names]
    ax1.bar(names, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], capsize=4,
            color=["#888", "#6a9", "#37c", "#c73"][:len(names)])
    ax1.set_ylabel("output GB/s (median, IQR)")
    c = result["config"]
    ax1.set_title(f"head_dim {c['head_dim']}, s {c['sparsity']}, {c['n_atoms']} atoms, "
                  f"{c['n_kv']} KV heads × {c['n_ctx']} tokens", fontsize=9)
    ax1.tick_params(axis="x", labelsize=8)
    if sweep:
        ss = [r["sparsity"] for r in sweep]
        ax2.plot(ss, [r["ratio_reconstruct_over_copy"]["median"] for r in sweep], "o-", label="reconstruct / copy")
        ax2.fill_between(ss, [r["ratio_reconstruct_over_copy"]["p25"] for r in sweep],
                         [r["ratio_reconstruct_over_copy"]["p75"] for r in sweep], alpha=0.25)
        ax2.axhline(GOAL, color="r", ls="--", label=f"goal {GOAL}")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("sparsity s")
        ax2.set_ylabel("bandwidth ratio (paired, median, IQR)")
        ax2.set_ylim(0, 1.2)
        ax2.legend()
    fig.suptitle(result["device"]["name"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = _args(argv)
    if not args.validation:  # must precede the first Vulkan instance
        os.environ["VK_LOADER_LAYERS_DISABLE"] = "VK_LAYER_KHRONOS_validation"
    from kvdict_vk.vk import get_device
    dev = get_device(args.device)
    rng = np.random.default_rng(0)
    sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    t0 = time.time()
    main_res = bench_sparsity(args.sparsity, args, dev, rng, numpy_too=True)
    sweep_res = [main_res if s == args.sparsity else bench_sparsity(s, args, dev, rng, numpy_too=False)
                 for s in sweep]
    result = {
        "tool": "tools/bench_reconstruct.py", "argv": sys.argv[1:] if argv is None else argv,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - t0, 1),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "device": dev.info.to_dict(), "validation_layer": bool(args.validation),
        "config": {k: getattr(args, k) for k in ("n_kv", "head_dim", "n_ctx", "n_atoms", "sparsity", "repeats",
                                                 "residual_bits", "per_head")},
        "goal_ratio": GOAL, "main": main_res, "sweep": sweep_res,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    _plot(result, png)
    m = main_res
    print(f"{dev.name}: head_dim {args.head_dim}, s {args.sparsity}, {args.n_atoms} atoms, "
          f"{args.n_kv}×{args.n_ctx} rows/stream, {m['output_bytes'] / 2**20:.1f} MiB out")
    for name in ("reconstruct", "copy_shader", "f32_cache_read", "numpy_reconstruct_f32", "readback"):
        r = m[name]
        print(f"  {name:22s} {1e3 * r['median']:9.2f} ms  [{1e3 * r['p25']:.2f}, {1e3 * r['p75']:.2f}]"
              f"  {r['output_gb_per_s']:7.3f} GB/s  {r['vectors_per_s'] / 1e6:8.3f} M vectors/s")
    ratio = m["ratio_reconstruct_over_copy"]
    print(f"  reconstruct / copy bandwidth: {ratio['median']:.3f} (paired, IQR {ratio['p25']:.3f}–"
          f"{ratio['p75']:.3f}; goal ≥ {GOAL})   NMSE vs float64 {m['nmse_vs_float64']:.2e}")
    for r in sweep_res:
        print(f"  sweep s={r['sparsity']:<3d} ratio {r['ratio_reconstruct_over_copy']['median']:.3f}  "
              f"reconstruct {r['reconstruct']['output_gb_per_s']:.3f} GB/s")
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
