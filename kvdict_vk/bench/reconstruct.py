"""Reconstruct-shader throughput vs the plain copy shader, the f32 and f16 cache reads and
NumPy, for the same output: every K and V row of n_ctx tokens as f32.

Each GPU candidate is recorded once and run again per repeat: GPU time from timestamps,
wall time around submit + wait; interleaved repeats (machine noise hits every candidate
alike), medians, and the paired copy / reconstruct ratio per repeat. The reads write into
one device-local buffer sized for the whole output (≥ 1 GiB on a GPU with the gpu preset,
past any L2), so only the shaders are timed; ``readback`` (the copy of a read-back buffer
to the host) is timed apart, over the largest range one read-back buffer holds. Bytes
from kvdict_vk.bench.traffic, over the copy roofline (kvdict_vk.bench.roofline).

    .venv/bin/python -m kvdict_vk.bench.reconstruct [--out out/bench_reconstruct.json]

Writes the JSON and a PNG (same stem) next to it. The goal (#13) is the reconstruct
shader's bandwidth — the bytes it moves (slots, dictionary, output) over its GPU time — at
≥ 0.7 of the copy roofline, at ≥ 1 GiB of output.
"""
from __future__ import annotations

import time

import numpy as np

from . import common, results, roofline, timing, traffic

NAME, TOOL = "reconstruct", "kvdict_vk.bench.reconstruct"
GOAL = 0.7
PRESETS = {"quick": ["--n-ctx", "2048", "--per-head", "--sweep", "", "--repeats", "5"],
           "cpu": ["--per-head"],
           # the certified format (s 4, a 4-bit residual, per-head dictionaries, head_dim 64):
           # 8 KV heads × 64 × 262 144 tokens, 1 GiB of f32 output per read
           "gpu": ["--n-kv", "8", "--head-dim", "64", "--n-ctx", "262144", "--sparsity", "4", "--residual-bits", "4",
                   "--per-head", "--sweep", "1,2,4,8,16", "--repeats", "10", "--no-numpy"]}
USES_DEVICE, REQUIRES = True, {}
CHECK_TOKENS = 256  # tokens read back and compared with NumPy per sparsity


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=9)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--sweep", default="1,2,4,8,16", help="sparsities for the scaling sweep ('' = none)")
    ap.add_argument("--residual-bits", type=int, default=0, help="residual stage bits per level (0 = none)")
    ap.add_argument("--per-head", action="store_true", help="one dictionary per KV head (default: shared)")
    ap.add_argument("--mapping", choices=["row", "chunk"], default=None,
                    help="shader invocation mapping (default: by device type — row on CPU drivers)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the NumPy reconstruct (slow at GPU sizes)")
    ap.add_argument("--atoms", choices=["f16", "f32"], default="f16",
                    help="f16: atoms that are binary16 values, as the forge makes them (the arena's binary16 "
                         "copy is gathered; the main sparsity is timed with f32 atoms beside it); "
                         "f32: any float32 atoms (the float32 block is gathered)")
    return common.parse(ap, argv)


def _dicts(s, args, rng, f16_atoms: bool) -> list:
    """Random K and V dictionaries at sparsity s; f16_atoms: atoms rounded to binary16
    values, as the forge rounds them (forge.learn)."""
    from kvdict_vk.dictionary import StreamDict, round_to_f16
    hd, na, bits = args.head_dim, args.n_atoms, args.residual_bits
    g = args.n_kv if args.per_head else 1
    dicts = []
    for _ in "kv":
        atoms = rng.standard_normal((g, na, hd), dtype=np.float32)
        dicts.append(StreamDict(round_to_f16(atoms) if f16_atoms else atoms,
                                mean=rng.standard_normal((g, hd), dtype=np.float32), sparsity=s, residual_bits=bits,
                                residual_scale=rng.random((g, hd), dtype=np.float32) + 0.5 if bits else None))
    return dicts


def _coded_arena(dicts, codes, args, dev):
    """A one-layer dict arena of n_ctx tokens holding ``codes`` over ``dicts``."""
    from kvdict_vk import runtime
    from kvdict_vk.dictionary import KvDictArtifact
    from kvdict_vk.vk import KvArena
    art = KvDictArtifact(args.head_dim, args.n_atoms, dicts[0].sparsity, ((dicts[0], dicts[1]),))
    with runtime.enabled_with(art, allow_uncertified=True):
        arena = KvArena(1, args.n_kv, args.head_dim, args.n_ctx, device=dev, shader_mapping=args.mapping,
                        cache="dict")
    try:
        arena.append_codes(0, *codes)
    except BaseException:
        arena.free()
        raise
    return arena


def coded_arena(s, args, dev, rng, f16_atoms: bool | None = None):
    """A one-layer dict arena of n_ctx tokens of random slots, the slots and dictionaries;
    f16_atoms None: as ``--atoms`` says."""
    f16_atoms = args.atoms == "f16" if f16_atoms is None else f16_atoms
    from kvdict_vk import synthetic
    dicts = _dicts(s, args, rng, f16_atoms)
    codes = [synthetic.random_slots(rng, d, (args.n_kv, args.n_ctx)) for d in dicts]
    return _coded_arena(dicts, codes, args, dev), codes, dicts


def _uncoded(args, dev, rng) -> dict:
    """f32 and f16 arenas holding the same n_ctx tokens (a random block repeated: the
    values do not change a copy's cost, and drawing 1 GiB of normals takes seconds)."""
    from kvdict_vk.vk import KvArena
    block = rng.standard_normal((args.n_kv, min(args.n_ctx, 1024), args.head_dim), dtype=np.float32)
    reps = -(-args.n_ctx // block.shape[1])
    rows = np.ascontiguousarray(np.tile(block, (1, reps, 1))[:, :args.n_ctx])
    arenas = {}
    for cache in ("f32", "f16"):
        arenas[cache] = KvArena(1, args.n_kv, args.head_dim, args.n_ctx, device=dev, shader_mapping=args.mapping,
                                cache=cache)
        arenas[cache].append(0, rows, rows)
    return arenas


def copy_recording(dev, n_words):
    """A recorded copy shader of n_words words between two device-local buffers."""
    from kvdict_vk.vk.kernels import Buffer, Kernel
    from kvdict_vk.vk.submit import Recording
    src, dst = Buffer(dev, n_words, "storage", "copy src"), Buffer(dev, n_words, "storage", "copy dst")
    kernel = Kernel(dev, "copy_vec4" if n_words % 4 == 0 else "copy_scalar", [src, dst], max_items=n_words)
    rec = Recording(dev, [kernel.op(src_word=0, dst_word=0, n_words=n_words)], timestamps=True, what="copy shader")
    return rec, [kernel, src, dst]


def nmse_check(arena, codes, dicts, n_ctx) -> float:
    from kvdict_vk import codec
    n = min(n_ctx, CHECK_TOKENS)
    k, _ = arena.read(0, 0, n)
    ref = codec.decode_heads(codes[0][:, :n], dicts[0])
    return float(np.sum((ref - k) ** 2) / np.sum(ref ** 2))


def bench_sparsity(s, args, dev, rng, out, copy_rec, baselines: dict, *, numpy_too: bool,
                   f32_atoms_too: bool = False) -> dict:
    """Reconstruct at sparsity ``s`` beside the copy shader (and ``baselines``: {name:
    (candidate, bytes moved, cache)}); every read writes into ``out``. f32_atoms_too (with
    --atoms f16): the same codes also over freshly drawn float32 atoms that are not binary16
    values (so the arena keeps them in float32), so binary16 atoms' gain is paired in one run."""
    from kvdict_vk import codec
    from kvdict_vk.vk import ReadPlan
    f16 = args.atoms == "f16"
    nmse_f32 = None
    arena, codes, dicts = coded_arena(s, args, dev, rng, f16)
    arenas, recs = [arena], []
    try:
        nmse = nmse_check(arena, codes, dicts, args.n_ctx)
        rec = ReadPlan(arena.memory, 0, 0, args.n_ctx, out=out).recording("dispatch", timestamps=True)
        recs.append(rec)
        rec.run()  # warm-up
        n_words = 2 * args.n_kv * args.n_ctx * args.head_dim
        cands = {"reconstruct": (rec, traffic.bytes_moved("read", arena.layout, 0, args.n_ctx), "dict"),
                 "copy_shader": (copy_rec, traffic.bytes_moved("copy", n_words=n_words), None), **baselines}
        if f16 and f32_atoms_too:
            plain = _dicts(s, args, rng, False)
            arenas.append(_coded_arena(plain, codes, args, dev))
            nmse_f32 = nmse_check(arenas[-1], codes, plain, args.n_ctx)
            rec32 = ReadPlan(arenas[-1].memory, 0, 0, args.n_ctx, out=out).recording("dispatch", timestamps=True)
            recs.append(rec32)
            rec32.run()
            cands["reconstruct_f32_atoms"] = (rec32, traffic.bytes_moved("read", arenas[-1].layout, 0, args.n_ctx),
                                              "dict")
        if numpy_too:
            cands["numpy_reconstruct_f32"] = (lambda: [codec.decode_heads(c, d, np.float32)
                                                       for c, d in zip(codes, dicts)], cands["reconstruct"][1], "dict")
        times = timing.measure({n: c[0] for n, c in cands.items()}, args.repeats, warm_s=timing.warm_for(arena.device))
    finally:
        for r in recs:
            r.free()
        for a in arenas:
            a.free()
    res = {"sparsity": s, "shader_mapping": arena.shader_mapping, "atoms": args.atoms,
           "atoms_gathered": "f16" if arena.layout.layers[0].k.atoms_f16 else "f32",
           "output_bytes": 4 * n_words,
           "head_vectors": 2 * args.n_kv * args.n_ctx, "nmse_vs_float64": nmse, "candidates": {}}
    if nmse_f32 is not None:
        res["nmse_f32_atoms_vs_float64"] = nmse_f32
    for name, t in times.items():
        moved, cache = cands[name][1], cands[name][2]
        sec = timing.best_seconds(t)
        res["candidates"][name] = {**t, "cache": cache, "bytes": moved,
                                   "output_gb_per_s": moved["output"] / sec / 1e9,
                                   "vectors_per_s": res["head_vectors"] / sec}
    basis = "gpu" if times["reconstruct"]["gpu"] and times["copy_shader"]["gpu"] else "wall"
    paired = [np.asarray(times[n][basis]["samples"]) for n in ("copy_shader", "reconstruct")]
    res["timing"] = basis
    res["ratio_reconstruct_over_copy"] = common.stats(paired[0] / paired[1])
    res["ratio_of_medians"] = times["copy_shader"][f"{basis}_s"] / times["reconstruct"][f"{basis}_s"]
    return res


def run(args, progress) -> dict:
    from kvdict_vk.vk.kernels import Buffer
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    t0 = time.time()
    roof = roofline.measure(dev)
    n_words = 2 * args.n_kv * args.n_ctx * args.head_dim
    progress(f"{dev.name}: s {args.sparsity}, {args.n_kv}×{args.n_ctx} rows/stream, "
             f"{4 * n_words / 2**20:.0f} MiB out; roofline {roof['bytes_per_s'] / 1e9:.2f} GB/s")
    out = Buffer(dev, n_words, "storage", "reconstructed rows")
    copy_rec, keep = copy_recording(dev, n_words)
    copy_rec.run()
    uncoded = _uncoded(args, dev, rng)
    base_recs = []
    try:
        from kvdict_vk.vk import ReadPlan
        baselines = {}
        for cache, arena in uncoded.items():
            rec = ReadPlan(arena.memory, 0, 0, args.n_ctx, out=out).recording("dispatch", timestamps=True)
            rec.run()
            base_recs.append(rec)
            baselines[f"{cache}_cache_read"] = (rec, traffic.bytes_moved("read", arena.layout, 0, args.n_ctx), cache)
        # the copy of one read-back buffer to the host, over the largest range it holds
        f32 = uncoded["f32"]
        n_rb = min(args.n_ctx, f32.memory.read_tokens)
        rb_plan = f32.read_plan(0, 0, n_rb)
        rb_plan.dispatch()
        rb = rb_plan.recording("readback", timestamps=True)
        baselines["readback"] = (rb, traffic.bytes_moved("copy", n_words=rb_plan.out.words), None)
        main_res = bench_sparsity(args.sparsity, args, dev, rng, out, copy_rec, baselines,
                                  numpy_too=not args.no_numpy, f32_atoms_too=True)
        main_res["readback_tokens"] = n_rb
        sweep_res = []
        for s in sweep:
            progress(f"sweep s={s} ({len(sweep_res) + 1}/{len(sweep)})")
            sweep_res.append(main_res if s == args.sparsity else
                             bench_sparsity(s, args, dev, rng, out, copy_rec, {}, numpy_too=False))
    finally:
        for rec in base_recs:
            rec.free()
        for a in uncoded.values():
            a.free()
        copy_rec.free()
        for x in keep:
            x.destroy()
        out.destroy()
    result = {**common.run_header(TOOL, args, dev, t0),
              "config": {k: getattr(args, k) for k in ("n_kv", "head_dim", "n_ctx", "n_atoms", "sparsity", "repeats",
                                                       "residual_bits", "per_head", "atoms")},
              "timing": "recorded dispatches run per repeat: GPU time from timestamps, wall time around submit + wait",
              "goal_ratio": GOAL, "roofline": roof, "main": main_res, "sweep": sweep_res}
    result["rows"] = make_rows(result)
    return result


ROW_NAMES = {"reconstruct": "reconstruct", "reconstruct_f32_atoms": "reconstruct f32-atoms",
             "copy_shader": "copy shader", "f32_cache_read": "f32 read",
             "f16_cache_read": "f16 read", "readback": "readback", "numpy_reconstruct_f32": "numpy reconstruct"}


def make_rows(result) -> list[dict]:
    """The main sparsity's candidates, then the sweep's other reconstructs. The readback
    (a transfer to host memory) and NumPy (the host) are not divided by the shader roofline."""
    c, roof, main = result["config"], result["roofline"], result["main"]
    todo = [(main, name) for name in main["candidates"]]
    todo += [(r, "reconstruct") for r in result["sweep"] if r["sparsity"] != main["sparsity"]]
    rows = []
    for res, name in todo:
        t = dict(res["candidates"][name])
        on_host, transfer = name.startswith("numpy"), name == "readback"
        if on_host:
            t["note"] = "NumPy on the host"
        tokens = main["readback_tokens"] if transfer else c["n_ctx"]
        sparse = ""
        if name in ("reconstruct", "reconstruct_f32_atoms", "numpy_reconstruct_f32"):  # the coded format
            sparse = f" s{res['sparsity']}" + (f" b{c['residual_bits']}" if c["residual_bits"] else "") \
                + (" per-head" if c["per_head"] else "")
        rows.append(results.row(
            NAME, f"{ROW_NAMES[name]}{sparse} {c['n_kv']}kv d{c['head_dim']} n{tokens}", t, cache=t["cache"],
            n_used=tokens, n_kv=c["n_kv"], head_dim=c["head_dim"], moved=t["bytes"],
            roofline=None if on_host or transfer else roof, output_bytes=res["output_bytes"],
            sparsity=res["sparsity"], device_kind="cpu" if on_host else _kind(result)))
    return rows


def _kind(result) -> str:
    return "cpu" if result["device"]["device_type"] == "cpu" else "gpu"


def rows(result) -> list[dict]:
    return result["rows"]


def headline(result) -> list[dict]:
    """The reconstruct shader's bandwidth (bytes it moves over its GPU time, where there are
    timestamps) as a fraction of the copy roofline, against the goal (#13: ≥ 0.7 at ≥ 1 GiB of
    output); beside it the time ratio to the copy shader over the same output bytes."""
    m = result["main"]["candidates"]
    rec, cp = timing.best_seconds(m["reconstruct"]), timing.best_seconds(m["copy_shader"])
    fraction = m["reconstruct"]["bytes"]["total"] / rec / result["roofline"]["bytes_per_s"]
    return [{"figure": "reconstruct bandwidth / copy roofline",
             "case": f"s {result['main']['sparsity']}, {result['config']['n_kv']}×{result['config']['n_ctx']} rows",
             "numerator": m["reconstruct"]["bytes"]["total"] / rec / 1e9,
             "denominator": result["roofline"]["bytes_per_s"] / 1e9, "unit": "GB/s", "ratio": fraction,
             "copy_time_over_reconstruct_time": cp / rec,
             "paired_ratio_median": result["main"]["ratio_reconstruct_over_copy"]["median"],
             "goal": {"at_least": result["goal_ratio"], "met": fraction >= result["goal_ratio"]}}]


def report(result) -> list[str]:
    m, c = result["main"], result["config"]
    lines = [f"{result['device']['name']}: head_dim {c['head_dim']}, s {c['sparsity']}, {c['n_atoms']} atoms, "
             f"{c['n_kv']}×{c['n_ctx']} rows/stream, {m['output_bytes'] / 2**20:.1f} MiB out; "
             f"roofline {result['roofline']['bytes_per_s'] / 1e9:.2f} GB/s ({m['timing']} time)"]
    for name, r in m["candidates"].items():
        lines.append(f"  {name:22s} {1e3 * timing.best_seconds(r):9.3f} ms  wall {1e3 * r['wall_s']:9.3f} ms"
                     f"  {r['output_gb_per_s']:8.3f} GB/s out")
    ratio = m["ratio_reconstruct_over_copy"]
    lines.append(f"  reconstruct / copy bandwidth: {ratio['median']:.3f} (paired, IQR {ratio['p25']:.3f}–"
                 f"{ratio['p75']:.3f})   NMSE vs float64 {m['nmse_vs_float64']:.2e}")
    lines.append(f"  reconstruct over the copy roofline: {headline(result)[0]['ratio']:.3f} (goal ≥ {result['goal_ratio']})")
    for r in result["sweep"]:
        lines.append(f"  sweep s={r['sparsity']:<3d} ratio {r['ratio_reconstruct_over_copy']['median']:.3f}  "
                     f"reconstruct {r['candidates']['reconstruct']['output_gb_per_s']:.3f} GB/s")
    return lines


def plot(plt, result):
    main, sweep = result["main"], result["sweep"]
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 6.5, 4.5), squeeze=False)
    ax1 = axes[0][0]
    names = [n for n in ("copy_shader", "f32_cache_read", "f16_cache_read", "reconstruct", "reconstruct_f32_atoms",
                         "numpy_reconstruct_f32")
             if n in main["candidates"]]
    ax1.bar(names, [main["candidates"][n]["output_gb_per_s"] for n in names])
    ax1.set_ylabel(f"output GB/s (median, {main['timing']} time)")
    c = result["config"]
    ax1.set_title(f"head_dim {c['head_dim']}, s {c['sparsity']}, {c['n_atoms']} atoms, "
                  f"{c['n_kv']} KV heads × {c['n_ctx']} tokens", fontsize=9)
    ax1.tick_params(axis="x", labelsize=7)
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
