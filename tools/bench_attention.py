#!/usr/bin/env python3
"""Decode-attention time per step: dict-coded attention vs the f32-cache attention vs
reconstruct-then-attend (GPU reconstruct of K/V into f32 rows, then the f32 kernels).

One device, one run, interleaved repeats (machine noise hits every mode alike), medians,
quartiles and the ratios paired per repeat. Host timing with time.perf_counter around the
whole KvArena.attend call (record + submit + wait + read back the (n_heads, head_dim)
output: what an engine pays per decode step; device timestamps are unreliable on
software drivers). Also a table of the bytes each mode reads per decode step.

    .venv/bin/python tools/bench_attention.py [--out out/bench_attention.json]

Writes the JSON and a PNG (same stem). Goal on lavapipe: dict-coded no slower than the
f32 cache at 8k tokens and faster at 32k.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODES = ("dict_coded", "f32_cache", "reconstruct_then_attend")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench_attention.json"))
    ap.add_argument("--n-used", default="1024,8192,32768", help="context lengths attended over")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-kv", type=int, default=3)
    ap.add_argument("--gqa", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--sparsity", type=int, default=8)
    ap.add_argument("--n-atoms", type=int, default=1024)
    ap.add_argument("--formats", default="0/0,4/3", help="K/V residual bits per format ('0/0' = none)")
    ap.add_argument("--per-head", action="store_true", help="one dictionary per KV head (default: shared)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-reconstruct", action="store_true", help="skip reconstruct-then-attend (slow)")
    ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
    ap.add_argument("--validation", action="store_true", help="keep the Khronos validation layer")
    return ap.parse_args(argv)


def _stats(samples) -> dict:
    a = np.asarray(samples, float)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)), "p75": float(np.percentile(a, 75)),
            "min": float(a.min()), "max": float(a.max()), "samples": a.tolist()}


def _random_slots(rng, d, n_kv, n_ctx):
    """Valid random slots: attention's cost does not depend on the code values."""
    from kvdict_vk import codec
    codes = codec.pack_codes(rng.integers(0, d.n_atoms, (n_kv, n_ctx, d.sparsity)),
                             rng.standard_normal((n_kv, n_ctx, d.sparsity)) * 0.3)
    extra = d.slot_words - d.sparsity
    if not extra:
        return codes
    levels = rng.integers(0, 1 << 32, (n_kv, n_ctx, extra - 1), dtype=np.uint64).astype(np.uint32)
    step = np.full((n_kv, n_ctx, 1), 0.05, np.float32).view(np.uint32)
    return np.concatenate([codes, levels, step], axis=-1)


def bytes_per_step(lay, att, n_used: int, mode: str) -> dict:
    """Bytes read per decode step (the query and output are a few KiB and left out).
    cache: the stored K/V representation of the n_used tokens; dictionary: atoms, means and
    residual scales read by the passes; scratch: the table lookups, score scratch, atom
    weights and partial results the kernels write and read back."""
    from kvdict_vk.vk.attend_specs import n_blocks
    hd, n_kv, w = lay.head_dim, lay.n_kv_heads, 4
    k, v = lay.layers[0].streams
    g, units = att.group, n_kv * (att.group // att.hb)
    n_heads = n_kv * g
    if mode == "f32_cache":
        return {"cache": 2 * n_kv * n_used * hd * w, "dictionary": 0, "scratch": 0}
    n_splits, _ = att.splits(n_used, 0)
    if mode == "dict_coded":
        s_k, s_v = k.sparsity, v.sparsity
        scratch = (n_kv * n_used * s_k * g  # table lookups
                   + 2 * n_heads * n_used  # scores written, read back
                   + 2 * n_kv * n_used * s_v * g  # atom-weight read-modify-writes
                   + 2 * n_kv * n_splits * g * lay.n_atoms  # bins read back and cleared
                   + n_heads * lay.n_atoms) * w  # the table written
        dictionary = (2 * units * lay.n_atoms * hd + 2 * n_kv * hd * (bool(k.residual_bits) + bool(v.residual_bits))) * w
        return {"cache": n_kv * n_used * (k.slot_words + v.slot_words) * w, "dictionary": dictionary,
                "scratch": scratch}
    # reconstruct-then-attend: slots + the gathered atoms, f32 rows written and read again
    gathered = n_kv * n_used * (k.sparsity + v.sparsity) * hd * w
    rows = 2 * n_kv * n_used * hd * w
    return {"cache": n_kv * n_used * (k.slot_words + v.slot_words) * w, "dictionary": gathered,
            "scratch": 2 * rows}


def bench_format(bits, args, dev, rng) -> dict:
    from kvdict_vk import runtime
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    from kvdict_vk.vk import KvArena
    hd, n_kv, na, s = args.head_dim, args.n_kv, args.n_atoms, args.sparsity
    n_used_values = [int(x) for x in args.n_used.split(",")]
    n_ctx = max(n_used_values)
    heads = n_kv if args.per_head else 1
    dicts = [StreamDict(rng.standard_normal((heads, na, hd), dtype=np.float32) / np.sqrt(hd),
                        mean=rng.standard_normal((heads, hd), dtype=np.float32) * 0.1, sparsity=s, residual_bits=b,
                        residual_scale=rng.random((heads, hd), dtype=np.float32) + 0.5 if b else None)
             for b in bits]
    runtime.enable(KvDictArtifact(hd, na, s, ((dicts[0], dicts[1]),)))
    try:
        coded = KvArena(1, n_kv, hd, n_ctx, device=dev)
    finally:
        runtime.deactivate()
    f32 = KvArena(1, n_kv, hd, n_ctx, device=dev)
    coded.append_codes(0, *(_random_slots(rng, d, n_kv, n_ctx) for d in dicts))
    rows = [rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32) for _ in "kv"]
    f32.append(0, *rows)
    q = rng.standard_normal((n_kv * args.gqa, hd), dtype=np.float32)
    att = coded.attention(q.shape[0])
    scale = 1.0 / np.sqrt(hd)
    calls = {"dict_coded": lambda n: coded.attend(0, q, n),
             "f32_cache": lambda n: f32.attend(0, q, n),
             "reconstruct_then_attend": lambda n: att.attend_reconstructed(0, q, n, scale)}
    modes = [m for m in MODES if not (args.no_reconstruct and m == "reconstruct_then_attend")]
    out = {"residual_bits": {"k": bits[0], "v": bits[1]},
           "slot_words": {"k": dicts[0].slot_words, "v": dicts[1].slot_words}, "by_n_used": []}
    for n in n_used_values:
        for m in modes:  # warm-up: pipelines compiled, buffers made
            calls[m](n)
        agree = float(np.sum((coded.attend(0, q, n) - att.attend_reconstructed(0, q, n, scale)) ** 2)
                      / np.sum(coded.attend(0, q, n) ** 2))
        times = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in modes:
                t = time.perf_counter()
                calls[m](n)
                times[m].append(time.perf_counter() - t)
        res = {"n_used": n, "splits_per_kv_head": att.splits(n, 0)[0],
               "coded_vs_reconstructed_nmse": agree, "seconds": {m: _stats(times[m]) for m in modes},
               "bytes": {m: bytes_per_step(coded.layout, att, n, m) for m in modes}}
        for m in modes:
            res["bytes"][m]["total"] = sum(res["bytes"][m].values())
        coded_t = np.asarray(times["dict_coded"])
        res["speedup_vs_f32"] = _stats(np.asarray(times["f32_cache"]) / coded_t)
        if "reconstruct_then_attend" in times:
            res["speedup_vs_reconstruct"] = _stats(np.asarray(times["reconstruct_then_attend"]) / coded_t)
        out["by_n_used"].append(res)
        print(f"  residual K{bits[0]}/V{bits[1]}  n_used {n:6d}: " + "  ".join(
            f"{m} {1e3 * res['seconds'][m]['median']:8.2f} ms" for m in modes)
            + f"  | f32/coded {res['speedup_vs_f32']['median']:.2f} (IQR {res['speedup_vs_f32']['p25']:.2f}–"
              f"{res['speedup_vs_f32']['p75']:.2f})", flush=True)
    for a in (coded, f32):
        a.free()
    return out


def _plot(result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fmts = result["formats"]
    fig, axes = plt.subplots(1, len(fmts), figsize=(6 * len(fmts), 4.5), squeeze=False)
    colors = {"dict_coded": "#37c", "f32_cache": "#888", "reconstruct_then_attend": "#c73"}
    for ax, fmt in zip(axes[0], fmts):
        rows = fmt["by_n_used"]
        modes = list(rows[0]["seconds"])
        x = np.arange(len(rows))
        width = 0.8 / len(modes)
        for i, m in enumerate(modes):
            med = np.array([1e3 * r["seconds"][m]["median"] for r in rows])
            lo = med - [1e3 * r["seconds"][m]["p25"] for r in rows]
            hi = np.array([1e3 * r["seconds"][m]["p75"] for r in rows]) - med
            ax.bar(x + (i - (len(modes) - 1) / 2) * width, med, width, yerr=[lo, hi], capsize=3,
                   label=m.replace("_", " "), color=colors[m])
        for xi, r in zip(x, rows):
            ax.annotate(f"×{r['speedup_vs_f32']['median']:.2f}", (xi, 1e3 * r["seconds"]["dict_coded"]["median"]),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{r['n_used']} tokens" for r in rows])
        ax.set_ylabel("ms per decode step (median, IQR)")
        rb = fmt["residual_bits"]
        ax.set_title(f"residual K{rb['k']}/V{rb['v']} bits (×: f32 / dict-coded)", fontsize=9)
        ax.legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"{result['device']['name']}: head_dim {c['head_dim']}, {c['n_kv']} KV heads × GQA {c['gqa']}, "
                 f"s {c['sparsity']}, {c['n_atoms']} atoms", fontsize=10)
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
    print(f"{dev.name}: head_dim {args.head_dim}, {args.n_kv} KV heads × GQA {args.gqa}, s {args.sparsity}, "
          f"{args.n_atoms} atoms ({'per-head' if args.per_head else 'shared'} dictionaries)")
    formats = [bench_format(tuple(int(b) for b in f.split("/")), args, dev, rng) for f in args.formats.split(",")]
    result = {
        "tool": "tools/bench_attention.py", "argv": sys.argv[1:] if argv is None else argv,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - t0, 1),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "device": dev.info.to_dict(), "validation_layer": bool(args.validation),
        "config": {k: getattr(args, k) for k in ("head_dim", "n_kv", "gqa", "sparsity", "n_atoms", "per_head",
                                                 "repeats")},
        "timing": "time.perf_counter around KvArena.attend (record, submit, wait, read back)",
        "formats": formats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    _plot(result, png)
    print("bytes read per decode step (MiB: cache + dictionary + scratch = total):")
    for fmt in formats:
        for r in fmt["by_n_used"]:
            print(f"  K{fmt['residual_bits']['k']}/V{fmt['residual_bits']['v']} n_used {r['n_used']:6d}: " + "   ".join(
                f"{m} {b['cache'] / 2**20:.2f}+{b['dictionary'] / 2**20:.2f}+{b['scratch'] / 2**20:.2f}"
                f"={b['total'] / 2**20:.2f}" for m, b in r["bytes"].items()))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
