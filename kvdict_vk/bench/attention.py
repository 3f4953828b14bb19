"""Decode-attention time per step: dict-coded attention vs the f32-cache attention vs
reconstruct-then-attend (GPU reconstruct of K/V into f32 rows, then the f32 kernels).

dict_coded is what KvArena.attend does (the cost model of kvdict_vk.vk.attend_plan picks
the direct or the table path); dict_direct and dict_table force one path each, so the JSON
shows whether the model picked the faster one.

One device, one run, interleaved repeats (machine noise hits every mode alike), medians,
quartiles and the ratios paired per repeat. Host timing with time.perf_counter around the
whole KvArena.attend call (record + submit + wait + read back the (n_heads, head_dim)
output: what an engine pays per decode step; device timestamps are unreliable on
software drivers). Also a table of the bytes each mode reads per decode step.

    .venv/bin/python -m kvdict_vk.bench.attention [--out out/bench_attention.json]

Writes the JSON and a PNG (same stem). Goal on lavapipe: dict-coded no slower than the
f32 cache at 8k tokens and faster at 32k.
"""
from __future__ import annotations

import time

import numpy as np

from . import common

NAME, TOOL = "attention", "kvdict_vk.bench.attention"
MODES = ("dict_coded", "dict_direct", "dict_table", "f32_cache", "reconstruct_then_attend")
QUICK = ["--n-used", "1024,4096", "--repeats", "5"]  # kvdict-bench --quick
USES_DEVICE, REQUIRES = True, {}


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=7)
    ap.add_argument("--n-used", default="1024,8192,32768", help="context lengths attended over")
    ap.add_argument("--gqa", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--formats", default="0/0,4/3", help="K/V residual bits per format ('0/0' = none)")
    ap.add_argument("--per-head", action="store_true", help="one dictionary per KV head (default: shared)")
    ap.add_argument("--no-reconstruct", action="store_true", help="skip reconstruct-then-attend (slow)")
    return common.parse(ap, argv)


def bytes_per_step(lay, att, n_used: int, mode: str) -> dict:
    """Bytes read per decode step (the query and output are a few KiB and left out).
    cache: the stored K/V representation of the n_used tokens; dictionary: atoms, means and
    residual scales read by the passes; scratch: the table lookups, score scratch, atom
    weights and partial results the kernels write and read back."""
    hd, n_kv, w = lay.head_dim, lay.n_kv_heads, 4
    k, v = lay.layers[0].streams
    g, units = att.group, n_kv * (att.group // att.hb)
    n_heads = n_kv * g
    if mode == "f32_cache":
        return {"cache": 2 * n_kv * n_used * hd * w, "dictionary": 0, "scratch": 0}
    if mode == "dict_coded":
        mode = f"dict_{att.plan(0, n_used).path}"
    if mode == "dict_direct":  # every unit decodes every key and value: s atom rows per token
        s_k, s_v = k.sparsity, v.sparsity
        scales = 2 * n_kv * hd * (bool(k.residual_bits) + bool(v.residual_bits))
        records = att.plan(0, n_used, path="direct").records
        return {"cache": units * n_used * (k.slot_words + v.slot_words) * w,
                "dictionary": (units * n_used * (s_k + s_v) * hd + scales) * w,
                "scratch": 2 * records * n_heads * (hd + 2) * w}
    n_splits = att.plan(0, n_used, path="table").n_splits
    if mode == "dict_table":
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


def bench_format(bits, args, dev, rng, progress) -> dict:
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
    with common.dictionary_active(KvDictArtifact(hd, na, s, ((dicts[0], dicts[1]),))):
        coded = KvArena(1, n_kv, hd, n_ctx, device=dev)
    f32 = KvArena(1, n_kv, hd, n_ctx, device=dev)
    coded.append_codes(0, *(common.random_slots(rng, d, n_kv, n_ctx) for d in dicts))
    rows = [rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32) for _ in "kv"]
    f32.append(0, *rows)
    q = rng.standard_normal((n_kv * args.gqa, hd), dtype=np.float32)
    att = coded.attention(q.shape[0])
    scale = 1.0 / np.sqrt(hd)
    modes = [m for m in MODES if not (args.no_reconstruct and m == "reconstruct_then_attend")]

    def forced(path):
        att.path = path
        try:
            return coded.attend(0, q, n)
        finally:
            att.path = None
    out = {"residual_bits": {"k": bits[0], "v": bits[1]},
           "slot_words": {"k": dicts[0].slot_words, "v": dicts[1].slot_words}, "by_n_used": []}
    for n in n_used_values:
        calls = {"dict_coded": lambda: forced(None),
                 "dict_direct": lambda: forced("direct"),
                 "dict_table": lambda: forced("table"),
                 "f32_cache": lambda: f32.attend(0, q, n),
                 "reconstruct_then_attend": lambda: att.attend_reconstructed(0, q, n, scale)}
        calls = {m: calls[m] for m in modes}
        for call in calls.values():  # warm-up: pipelines compiled, buffers made
            call()
        agree = float(np.sum((coded.attend(0, q, n) - att.attend_reconstructed(0, q, n, scale)) ** 2)
                      / np.sum(coded.attend(0, q, n) ** 2))
        times, _ = common.interleaved(calls, args.repeats)
        res = {"n_used": n, "splits_per_kv_head": att.splits(n, 0)[0], "path_chosen": att.plan(0, n).path,
               "coded_vs_reconstructed_nmse": agree, "seconds": {m: common.stats(times[m]) for m in modes},
               "bytes": {m: bytes_per_step(coded.layout, att, n, m) for m in modes}}
        for m in modes:
            res["bytes"][m]["total"] = sum(res["bytes"][m].values())
        coded_t = np.asarray(times["dict_coded"])
        res["speedup_vs_f32"] = common.stats(np.asarray(times["f32_cache"]) / coded_t)
        if "reconstruct_then_attend" in times:
            res["speedup_vs_reconstruct"] = common.stats(np.asarray(times["reconstruct_then_attend"]) / coded_t)
        out["by_n_used"].append(res)
        progress(f"residual K{bits[0]}/V{bits[1]} n_used {n}: f32/coded {res['speedup_vs_f32']['median']:.2f}")
    for a in (coded, f32):
        a.free()
    return out


def run(args, progress) -> dict:
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    t0 = time.time()
    progress(f"{dev.name}: head_dim {args.head_dim}, {args.n_kv} KV heads × GQA {args.gqa}, s {args.sparsity}, "
             f"{args.n_atoms} atoms ({'per-head' if args.per_head else 'shared'} dictionaries)")
    formats = [bench_format(tuple(int(b) for b in f.split("/")), args, dev, rng, progress)
               for f in args.formats.split(",")]
    return {**common.run_header(TOOL, args, dev, t0),
            "config": {k: getattr(args, k) for k in ("head_dim", "n_kv", "gqa", "sparsity", "n_atoms", "per_head",
                                                     "repeats")},
            "timing": "time.perf_counter around KvArena.attend (record, submit, wait, read back)",
            "formats": formats}


def _format(fmt) -> str:
    return f"K{fmt['residual_bits']['k']}/V{fmt['residual_bits']['v']}"


def headline(result) -> list[dict]:
    """dict-coded / f32-cache time per decode step (medians) at each format and n_used."""
    return [{"figure": "dict-coded / f32 cache time", "case": f"{_format(fmt)} n_used {r['n_used']}",
             "numerator": r["seconds"]["dict_coded"]["median"], "denominator": r["seconds"]["f32_cache"]["median"],
             "unit": "s", "ratio": r["seconds"]["dict_coded"]["median"] / r["seconds"]["f32_cache"]["median"]}
            for fmt in result["formats"] for r in fmt["by_n_used"]]


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: per decode step (median ms; f32/coded paired, IQR):"]
    for fmt in result["formats"]:
        for r in fmt["by_n_used"]:
            sp = r["speedup_vs_f32"]
            lines.append(f"  residual {_format(fmt)}  n_used {r['n_used']:6d}: " + "  ".join(
                f"{m} {1e3 * t['median']:8.2f} ms" for m, t in r["seconds"].items())
                + f"  | f32/coded {sp['median']:.2f} (IQR {sp['p25']:.2f}–{sp['p75']:.2f})")
    lines.append("bytes read per decode step (MiB: cache + dictionary + scratch = total):")
    for fmt in result["formats"]:
        for r in fmt["by_n_used"]:
            lines.append(f"  {_format(fmt)} n_used {r['n_used']:6d}: " + "   ".join(
                f"{m} {b['cache'] / 2**20:.2f}+{b['dictionary'] / 2**20:.2f}+{b['scratch'] / 2**20:.2f}"
                f"={b['total'] / 2**20:.2f}" for m, b in r["bytes"].items()))
    return lines


def plot(plt, result):
    fmts = result["formats"]
    fig, axes = plt.subplots(1, len(fmts), figsize=(6 * len(fmts), 4.5), squeeze=False)
    colors = {"dict_coded": "#37c", "dict_direct": "#7ad", "dict_table": "#9bd", "f32_cache": "#888",
              "reconstruct_then_attend": "#c73"}
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
        ax.set_title(f"residual {_format(fmt)} bits (×: f32 / dict-coded)", fontsize=9)
        ax.legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"{result['device']['name']}: head_dim {c['head_dim']}, {c['n_kv']} KV heads × GQA {c['gqa']}, "
                 f"s {c['sparsity']}, {c['n_atoms']} atoms", fontsize=10)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
