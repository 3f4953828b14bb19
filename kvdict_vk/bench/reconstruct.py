"""Reconstruct-shader throughput vs. the plain copy shader, the f32 cache read and NumPy.

One device, one run, interleaved repeats (so machine noise hits every candidate alike);
medians, quartiles and the paired copy/reconstruct ratio per repeat. Host timing with
time.perf_counter around Sequence.eval (device timestamps are unreliable on software
drivers); the dispatch is timed without the read-back, which is reported separately.

    .venv/bin/python -m kvdict_vk.bench.reconstruct [--out out/bench_reconstruct.json]

Writes the JSON and a PNG (same stem) next to it. The goal is reconstruct ≥ 0.7× the copy
shader's bandwidth for the same output bytes.
"""
from __future__ import annotations

import time

import numpy as np

from . import common

NAME, TOOL = "reconstruct", "kvdict_vk.bench.reconstruct"
GOAL = 0.7
QUICK = ["--n-ctx", "2048", "--sweep", "", "--repeats", "5"]  # kvdict-bench --quick
USES_DEVICE, REQUIRES = True, {}


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=9)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--sweep", default="1,2,4,8,16", help="sparsities for the scaling sweep ('' = none)")
    ap.add_argument("--residual-bits", type=int, default=0, help="residual stage bits per level (0 = none)")
    ap.add_argument("--per-head", action="store_true", help="one dictionary per KV head (default: shared)")
    ap.add_argument("--mapping", choices=["row", "chunk"], default=None,
                    help="shader invocation mapping (default: by device type — row on CPU drivers)")
    return common.parse(ap, argv)


def _setup(s, args, dev, rng):
    """A one-layer dict arena filled with n_ctx tokens of random codes, and the same words
    for NumPy."""
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    from kvdict_vk.vk import KvArena
    hd, na, n_kv, n_ctx, bits = args.head_dim, args.n_atoms, args.n_kv, args.n_ctx, args.residual_bits
    g = n_kv if args.per_head else 1
    dicts = [StreamDict(rng.standard_normal((g, na, hd), dtype=np.float32),
                        mean=rng.standard_normal((g, hd), dtype=np.float32), sparsity=s, residual_bits=bits,
                        residual_scale=rng.random((g, hd), dtype=np.float32) + 0.5 if bits else None)
             for _ in "kv"]
    with common.dictionary_active(KvDictArtifact(hd, na, s, ((dicts[0], dicts[1]),))):
        arena = KvArena(1, n_kv, hd, n_ctx, device=dev, shader_mapping=args.mapping)
    codes = [common.random_slots(rng, d, n_kv, n_ctx) for d in dicts]
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
    """The candidates at sparsity ``s``; an f32 arena with the same rows for the baseline read."""
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
    times, _ = common.interleaved(cand, args.repeats)
    vectors = 2 * args.n_kv * args.n_ctx  # head vectors produced per read (K and V)
    res = {"sparsity": s, "shader_mapping": arena.shader_mapping, "output_bytes": out_bytes,
           "head_vectors": vectors, "nmse_vs_float64": nmse}
    for name, t in times.items():
        st = common.stats(t)
        st["output_gb_per_s"] = out_bytes / st["median"] / 1e9
        st["vectors_per_s"] = vectors / st["median"]
        res[name] = st
    paired = np.asarray(times["copy_shader"]) / np.asarray(times["reconstruct"])
    res["ratio_reconstruct_over_copy"] = common.stats(paired)
    res["ratio_of_medians"] = res["copy_shader"]["median"] / res["reconstruct"]["median"]
    for x in (arena, f32):
        x.free()
    for x in keep:
        x.destroy()
    return res


def run(args, progress) -> dict:
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    t0 = time.time()
    progress(f"{dev.name}: s {args.sparsity}, {args.n_kv}×{args.n_ctx} rows/stream")
    main_res = bench_sparsity(args.sparsity, args, dev, rng, numpy_too=True)
    sweep_res = []
    for s in sweep:
        progress(f"sweep s={s} ({len(sweep_res) + 1}/{len(sweep)})")
        sweep_res.append(main_res if s == args.sparsity else bench_sparsity(s, args, dev, rng, numpy_too=False))
    return {**common.run_header(TOOL, args, dev, t0),
            "config": {k: getattr(args, k) for k in ("n_kv", "head_dim", "n_ctx", "n_atoms", "sparsity", "repeats",
                                                     "residual_bits", "per_head")},
            "goal_ratio": GOAL, "main": main_res, "sweep": sweep_res}


def headline(result) -> list[dict]:
    """Reconstruct / copy-shader bandwidth for the same output bytes (ratio of the medians)
    against the goal."""
    m = result["main"]
    ratio = m["reconstruct"]["output_gb_per_s"] / m["copy_shader"]["output_gb_per_s"]
    return [{"figure": "reconstruct / copy shader bandwidth",
             "case": f"s {m['sparsity']}, {result['config']['n_kv']}×{result['config']['n_ctx']} rows",
             "numerator": m["reconstruct"]["output_gb_per_s"], "denominator": m["copy_shader"]["output_gb_per_s"],
             "unit": "GB/s", "ratio": ratio, "paired_ratio_median": m["ratio_reconstruct_over_copy"]["median"],
             "goal": {"at_least": result["goal_ratio"], "met": ratio >= result["goal_ratio"]}}]


def report(result) -> list[str]:
    m, c = result["main"], result["config"]
    lines = [f"{result['device']['name']}: head_dim {c['head_dim']}, s {c['sparsity']}, {c['n_atoms']} atoms, "
             f"{c['n_kv']}×{c['n_ctx']} rows/stream, {m['output_bytes'] / 2**20:.1f} MiB out"]
    for name in ("reconstruct", "copy_shader", "f32_cache_read", "numpy_reconstruct_f32", "readback"):
        r = m[name]
        lines.append(f"  {name:22s} {1e3 * r['median']:9.2f} ms  [{1e3 * r['p25']:.2f}, {1e3 * r['p75']:.2f}]"
                     f"  {r['output_gb_per_s']:7.3f} GB/s  {r['vectors_per_s'] / 1e6:8.3f} M vectors/s")
    ratio = m["ratio_reconstruct_over_copy"]
    lines.append(f"  reconstruct / copy bandwidth: {ratio['median']:.3f} (paired, IQR {ratio['p25']:.3f}–"
                 f"{ratio['p75']:.3f}; goal ≥ {result['goal_ratio']})   NMSE vs float64 {m['nmse_vs_float64']:.2e}")
    for r in result["sweep"]:
        lines.append(f"  sweep s={r['sparsity']:<3d} ratio {r['ratio_reconstruct_over_copy']['median']:.3f}  "
                     f"reconstruct {r['reconstruct']['output_gb_per_s']:.3f} GB/s")
    return lines


def plot(plt, result):
    main, sweep = result["main"], result["sweep"]
    # no sweep asked for (kvdict-bench --quick): the bars alone, no empty axes
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 6.5, 4.5), squeeze=False)
    ax1 = axes[0][0]
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
        ax2 = axes[0][1]
        ss = [r["sparsity"] for r in sweep]
        ax2.plot(ss, [r["ratio_reconstruct_over_copy"]["median"] for r in sweep], "o-", label="reconstruct / copy")
        ax2.fill_between(ss, [r["ratio_reconstruct_over_copy"]["p25"] for r in sweep],
                         [r["ratio_reconstruct_over_copy"]["p75"] for r in sweep], alpha=0.25)
        ax2.axhline(result["goal_ratio"], color="r", ls="--", label=f"goal {result['goal_ratio']}")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("sparsity s")
        ax2.set_ylabel("bandwidth ratio (paired, median, IQR)")
        ax2.set_ylim(0, 1.2)
        ax2.legend()
    fig.suptitle(result["device"]["name"], fontsize=10)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
