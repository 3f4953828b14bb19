"""GPU OMP encoder (kvdict_vk.vk.encode.encoder) vs the CPU reference codec.encode, vectors per second.

One device, one run, interleaved repeats (machine noise hits every candidate alike);
median, quartiles and min/max per candidate, per residual-bit configuration. Candidates:

* ``gpu_encode`` (GpuEncoder.encode: upload, dispatches, read-back) and ``gpu_encode_into``
  (GpuEncoder.encode_into a device buffer: no read-back, the arena's write path) — wall
  time with time.perf_counter (a call is host work plus a submission per batch);
* ``gpu_prefill`` (the dispatches of one encode_into batch of every token, recorded once and
  timed by GPU timestamps) and ``gpu_decode_token`` (one token of every KV head, the same
  way, through an encoder of its own) — GPU time, after the clocks are raised
  (timing.measure's warm_s), the two interleaved: a token alone is too little work to hold
  a GPU's clocks up (measured on the H200: the same dispatch 1.5–4× slower when timed
  alone), and in an engine it runs between a layer's other kernels;
* ``cpu_codec_encode`` (codec.encode_heads, NumPy).

The encoder is the device's default form (GpuEncoder kernel "auto": tiled on GPUs,
stepwise on CPU drivers), the dictionary per KV head with ``--per-head`` (the certified
format's: 1024 atoms per KV head). Pipelines are created before the first timed repeat.
Also reported: how often both pick the same atom set and how often the whole slot is
identical. Rows (summary.json) carry vectors_per_s (from GPU time where the candidate has
it) and device_kind: "gpu" or "cpu" for the Vulkan device's kind (a software driver is a
CPU), "cpu" for the NumPy codec.

    .venv/bin/python -m kvdict_vk.bench.encode [--out out/bench_encode.json]

Writes the JSON and a PNG (same stem) next to it.
"""
from __future__ import annotations

import time

import numpy as np

from . import common, results, timing

NAME, TOOL = "encode", "kvdict_vk.bench.encode"
CANDIDATES = ("gpu_encode", "gpu_encode_into", "gpu_prefill", "gpu_decode_token", "cpu_codec_encode")
RECORDED = ("gpu_prefill", "gpu_decode_token")
PRESETS = {"quick": ["--n-tok", "128", "--per-head", "--repeats", "3"], "cpu": ["--per-head"],
           "gpu": ["--n-tok", "4096", "--n-kv", "8", "--sparsity", "4", "--residual-bits", "0,3,4", "--per-head",
                   "--repeats", "5"]}
WARM_S = 0.3  # untimed GPU work before the recorded candidates' rounds (clocks; timing.measure)
USES_DEVICE, REQUIRES = True, {}


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=5)
    ap.add_argument("--n-tok", type=int, default=1024, help="tokens per KV head per encode call")
    ap.add_argument("--residual-bits", default="0,4", help="one configuration per value")
    ap.add_argument("--per-head", action="store_true", help="a dictionary per KV head (else one shared)")
    return common.parse(ap, argv)


def bench_config(bits: int, args, dev, rng, progress) -> dict:
    from kvdict_vk import codec
    from kvdict_vk.dictionary import StreamDict
    from kvdict_vk.vk.encode.encoder import GpuEncoder
    from kvdict_vk.vk.kernels import Buffer
    from kvdict_vk.vk.submit import Recording
    hd, na, s = args.head_dim, args.n_atoms, args.sparsity
    heads = args.n_kv if args.per_head else 1
    atoms = rng.standard_normal((heads, na, hd))
    atoms = (atoms / np.linalg.norm(atoms, axis=2, keepdims=True)).astype(np.float32)
    mean = rng.standard_normal((heads, hd)).astype(np.float32)
    d = StreamDict(atoms if args.per_head else atoms[0], mean=mean if args.per_head else mean[0], sparsity=s,
                   residual_bits=bits,
                   residual_scale=(rng.random((heads, hd) if args.per_head else hd) + 0.5).astype(np.float32)
                   if bits else None)
    x = (mean[:, None, :] + rng.standard_normal((args.n_kv, args.n_tok, hd))).astype(np.float32)
    n = x.shape[0] * x.shape[1]
    t = time.perf_counter()
    enc = GpuEncoder(dev, d)
    dest = Buffer(dev, n * d.slot_words, "storage", "bench destination")
    enc.encode(x[:, :1])
    enc.encode_into(dest, x[:, :1], 0, args.n_tok, 0)  # both pick pipelines exist before timing
    setup = time.perf_counter() - t
    # the recorded candidates: one prefill batch of every token (when it fits one batch) and
    # one token of every KV head, each through its own encoder (ops_into stages its input in
    # the encoder's input buffer, which a recording reads when it runs), timed interleaved
    token_enc = GpuEncoder(dev, d)
    recorded = {"gpu_prefill": (enc, x, n)} if n <= enc.capacity else {}
    recorded["gpu_decode_token"] = (token_enc, x[:, :1], args.n_kv)
    recs = {}
    try:
        for name, (e, xs, _) in recorded.items():
            recs[name] = Recording(dev, e.ops_into(dest, xs, 0, args.n_tok, 0), timestamps=True, what=f"bench {name}")
        times = timing.measure(recs, args.repeats, warm_s=WARM_S if not dev.is_cpu else 0.0)
        shapes = {"gpu_prefill": enc.launch_shapes(), "gpu_decode_token": token_enc.launch_shapes()}
    finally:
        for rec in recs.values():
            rec.free()
        token_enc.free()
    cands = {"gpu_encode": lambda: enc.encode(x),
             "gpu_encode_into": lambda: enc.encode_into(dest, x, 0, args.n_tok, 0),
             "cpu_codec_encode": lambda: codec.encode_heads(x, d)}
    secs, outs = common.interleaved(cands, args.repeats, lambda rep, secs: progress(
        f"residual {bits} bits, repeat {rep + 1}/{args.repeats}: "
        + ", ".join(f"{k} {n / v[-1]:,.0f} vec/s" for k, v in secs.items())))
    gpu, cpu = outs["gpu_encode"], outs["cpu_codec_encode"]
    gi, ci = (np.sort(codec.unpack_codes(a[..., :s])[0], -1) for a in (gpu, cpu))
    rel = lambda slots: float(np.sum((codec.decode_heads(slots, d) - x) ** 2) / np.sum(x.astype(np.float64) ** 2))
    result = {"residual_bits": bits, "slot_words": d.slot_words, "n_vectors": n, "encoder_kernel": enc.kernel,
              "atom_block": enc.atom_block, "batch_capacity": enc.capacity, "setup_seconds": setup,
              "launch_shapes": shapes,
              "per_head": bool(args.per_head),
              "same_atom_sets": float((gi == ci).all(-1).mean()),
              "identical_slots": float((gpu == cpu).all(-1).mean()),
              "rel_error": {"gpu": rel(gpu), "cpu": rel(cpu)}}
    for name, v in secs.items():
        result[name] = {"seconds": common.stats(v), "vectors_per_s": common.stats([n / t for t in v]),
                        "timing": timing.timing(v, recorded=False), "n_vectors": n}
    for name, (_, _, count) in recorded.items():
        tm = times[name]
        per_call = tm["gpu"]["samples"] if tm["gpu"] else tm["wall"]["samples"]
        result[name] = {"seconds": common.stats(per_call), "vectors_per_s": common.stats([count / t for t in per_call]),
                        "timing": tm, "n_vectors": count}
    ratios = [c / g for g, c in zip(secs["gpu_encode"], secs["cpu_codec_encode"])]
    result["gpu_over_cpu_speed"] = common.stats(ratios)  # paired per repeat
    dest.destroy()
    enc.free()
    return result


def run(args, progress) -> dict:
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    t0 = time.time()
    configs = [bench_config(int(b), args, dev, rng, progress) for b in args.residual_bits.split(",") if b.strip()]
    result = {**common.run_header(TOOL, args, dev, t0),
              "config": {k: getattr(args, k) for k in ("n_kv", "n_tok", "head_dim", "n_atoms", "sparsity", "repeats")},
              "configs": configs}
    result["rows"] = make_rows(result)
    return result


def make_rows(result) -> list[dict]:
    c = result["config"]
    kind = "cpu" if result["device"]["device_type"] == "cpu" else "gpu"
    rows = []
    for cfg in result["configs"]:
        for name in CANDIDATES:
            if name not in cfg:  # gpu_prefill: only where every token fits one batch
                continue
            t = dict(cfg[name]["timing"])
            if name == "cpu_codec_encode":
                t["note"] = "NumPy on the host"
            rows.append(results.row(NAME, f"{name} r{cfg['residual_bits']} d{c['head_dim']} s{c['sparsity']}", t,
                                    cache="dict", n_kv=c["n_kv"], head_dim=c["head_dim"],
                                    vectors_per_s=cfg[name]["vectors_per_s"]["median"],
                                    n_vectors=cfg[name]["n_vectors"],
                                    device_kind="cpu" if name == "cpu_codec_encode" else kind,
                                    residual_bits=cfg["residual_bits"], per_head=cfg.get("per_head", False),
                                    encoder_kernel=None if name == "cpu_codec_encode" else cfg.get("encoder_kernel")))
    return rows


def rows(result) -> list[dict]:
    return result["rows"]


def headline(result) -> list[dict]:
    """GPU (with read-back) / CPU encode speed: the medians of vectors per second."""
    figures = []
    for c in result["configs"]:
        gpu, cpu = (c[k]["vectors_per_s"]["median"] for k in ("gpu_encode", "cpu_codec_encode"))
        figures.append({"figure": "GPU / CPU encode speed", "case": f"residual {c['residual_bits']} bits",
                        "numerator": gpu, "denominator": cpu, "unit": "vectors/s", "ratio": gpu / cpu,
                        "paired_ratio_median": c["gpu_over_cpu_speed"]["median"]})
        if "gpu_prefill" in c:  # the recorded batch: GPU time where the device has timestamps
            pre = c["gpu_prefill"]["vectors_per_s"]["median"]
            how = "GPU" if c["gpu_prefill"]["timing"]["gpu_s"] is not None else "wall"
            figures.append({"figure": f"prefill encode ({how} time) / CPU", "case": f"residual {c['residual_bits']} bits",
                            "numerator": pre, "denominator": cpu, "unit": "vectors/s", "ratio": pre / cpu})
    return figures


def report(result) -> list[str]:
    c = result["config"]
    lines = [f"{result['device']['name']}: head_dim {c['head_dim']}, {c['n_atoms']} atoms, s {c['sparsity']}, "
             f"{c['n_kv']}×{c['n_tok']} vectors per call, {c['repeats']} interleaved repeats"]
    for c in result["configs"]:
        lines.append(f"  residual bits {c['residual_bits']}: same atom sets {c['same_atom_sets']:.4f}, "
                     f"identical slots {c['identical_slots']:.4f}, setup {c['setup_seconds']:.1f} s")
        for name in (n for n in CANDIDATES if n in c):
            v = c[name]["vectors_per_s"]
            how = "GPU time" if name in RECORDED and c[name]["timing"]["gpu_s"] is not None else "wall"
            lines.append(f"    {name:18s} {v['median']:12,.0f} vec/s  [{v['p25']:,.0f}, {v['p75']:,.0f}]  "
                         f"{1e6 * c[name]['seconds']['median']:,.1f} µs per call ({how})")
        r = c["gpu_over_cpu_speed"]
        lines.append(f"    GPU / CPU speed (paired): {r['median']:.2f} [{r['p25']:.2f}, {r['p75']:.2f}]")
    return lines


def plot(plt, result):
    configs = result["configs"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(CANDIDATES)
    for i, name in enumerate(CANDIDATES):
        pick = lambda k: [c[name]["vectors_per_s"][k] if name in c else 0.0 for c in configs]
        med, lo, hi = pick("median"), pick("p25"), pick("p75")
        pos = np.arange(len(configs)) + (i - (len(CANDIDATES) - 1) / 2) * width
        ax.bar(pos, med, width, yerr=[np.subtract(med, lo), np.subtract(hi, med)], capsize=3,
               label=name, color=["#37c", "#6a9", "#139", "#9b5", "#c73"][i])
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(configs)),
                  [f"residual {c['residual_bits']} bits" if c["residual_bits"] else "no residual" for c in configs])
    ax.set_ylabel("vectors / s (median, IQR)")
    c = result["config"]
    ax.set_title(f"{result['device']['name']}\nhead_dim {c['head_dim']}, {c['n_atoms']} atoms, s {c['sparsity']}, "
                 f"{c['n_kv']}×{c['n_tok']} vectors per call", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
