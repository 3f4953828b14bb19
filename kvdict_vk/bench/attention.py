"""Decode-attention time per step over the f16, f32 and dict-coded caches, and
reconstruct-then-attend (GPU reconstruct of K/V into f32 rows, then the f32 kernels).

Per case — KV heads × GQA (``--shapes``), head_dim (``--head-dims``), context length
(``--n-used``) — every mode attends one query over the same context:

* ``f16_cache`` / ``f32_cache`` — the uncoded caches, on the path their engine picks
  (attend_flash on GPUs, attend_direct on CPU drivers); where that is not attend_direct,
  ``f16_cache_direct`` / ``f32_cache_direct`` force it, beside;
* ``dict_<fmt>`` — what KvArena.attend does over the codes (the cost model of
  kvdict_vk.vk.attend.plan picks the direct or the table path); ``dict_<fmt>_direct`` and
  ``dict_<fmt>_table`` force one path each, so the JSON shows whether it picked the faster;
* ``recon_<fmt>`` — reconstruct-then-attend (two submissions: wall time only);
* with ``--batches``: batched decode, B sequences of ``--batch-n-used`` tokens in one call
  (kvdict_vk.bench.attention_batch), rows with ``batch`` = B, SDPA at the same B.

Each attention is recorded once (Attention.recording: query upload, passes, read-back of
the output) and run again per repeat: GPU time from timestamps (first to last), wall time
around the submit and wait. One device, one run, interleaved repeats (machine noise hits
every mode alike), medians. Bytes per mode from kvdict_vk.bench.traffic, over the copy
roofline (kvdict_vk.bench.roofline). Where PyTorch with CUDA is importable, the same shape
through torch's scaled_dot_product_attention over an f16 cache (kvdict_vk.bench.torch_anchor).

    .venv/bin/python -m kvdict_vk.bench.attention [--out out/bench_attention.json]
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..dictionary import FORGE_RESIDUAL_BITS
from . import attention_batch, common, results, roofline, timing, torch_anchor, traffic
from .attention_common import (FLUSH_WAYS, dict_arena, flush_before, format_name,  # noqa: F401  (public here too)
                               our_flush_bytes, our_recording_args, random_rows)

NAME, TOOL = "attention", "kvdict_vk.bench.attention"
# every preset: the certified format's dictionaries — shared by a layer's KV heads since stop 60
# (per-head before: --per-head) — and code words a slot (forge.pipeline.ForgeConfig; the parser's
# default was 8 until 2026-12-03, which made every coded row before then twice the certified code words)
PRESETS = {"quick": ["--n-used", "1024,4096", "--repeats", "5", "--sdpa-calls", "20"],
           "cpu": [],
           # the shapes, contexts well past a GPU's L2 (131 072 tokens of 8 × 128 f16: 512 MiB);
           # our passes timed as SDPA's kernel is: behind other work, the L2 flushed, not their first
           # dispatch in the submission (--our-flush primed; docs/DESIGN.md, "The first dispatch")
           "gpu": ["--shapes", "8x4,3x3", "--head-dims", "64,128", "--n-used", "8192,32768,131072",
                   "--formats", "0/0,4/3,6/4", "--repeats", "20",
                   "--case-budget-s", "10", "--batches", "8,64", "--our-flush", "primed"]}
USES_DEVICE, REQUIRES = True, {}
UNCODED = ("f16", "f32", "q8_0")
KIVI = "kivi"  # KvArena(cache="kivi"), default settings
DEFAULT_FORMAT = format_name(FORGE_RESIDUAL_BITS)  # the forge's default format: its rows say "default"


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=7)
    ap.add_argument("--n-used", default="1024,8192,32768", help="context lengths attended over")
    ap.add_argument("--gqa", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--shapes", default=None, help="KV heads x GQA, comma-separated (default: --n-kv x --gqa)")
    ap.add_argument("--head-dims", default=None, help="comma-separated (default: --head-dim)")
    ap.add_argument("--formats", default="0/0,4/3", help="K/V residual bits per dict format ('0/0' = none)")
    ap.add_argument("--per-head", action="store_true", help="one dictionary per KV head (default: shared)")
    ap.add_argument("--window", default="", help="SINK/RECENT: each dict format also with that exact window "
                                                 "(kvdict_vk.window), e.g. 1/32")
    ap.add_argument("--key-rope", action="store_true", help="each dict format also with its keys coded before "
                                                             "RoPE (kvdict_vk.rope: attend_direct turns them)")
    ap.add_argument("--no-reconstruct", action="store_true", help="skip reconstruct-then-attend")
    ap.add_argument("--case-budget-s", type=float, default=30.0,
                    help="seconds the repeats of one context length may take (fewer repeats, at least 3, past it)")
    ap.add_argument("--sdpa-calls", type=int, default=100, help="timed torch SDPA calls per case")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA anchor")
    ap.add_argument("--l2-flush-mib", type=int, default=torch_anchor.L2_FLUSH_BYTES >> 20,
                    help="with torch + CUDA: a read of this many MiB before every timed call, ours and SDPA's "
                         "(0: back to back, a small cache then stays in the L2)")
    ap.add_argument("--engine-paths-only", action="store_true",
                    help="only the path each cache's engine plans (no forced direct/table paths beside it)")
    ap.add_argument("--batches", default="", help="batched decode: batch sizes B, comma-separated (default: none)")
    ap.add_argument("--batch-n-used", type=int, default=8192, help="tokens per sequence of a batch")
    ap.add_argument("--our-flush", choices=FLUSH_WAYS, default="torch",
                    help="how our recorded attentions meet --l2-flush-mib: 'torch' (its read and a host sync "
                         "before each submission: the GPU idles before the passes), 'submission' (l2_flush "
                         "in the same submission, right before the passes: the GPU busy, as SDPA's queued calls "
                         "are; Attention.flush_ops) or 'primed' (as 'submission', the passes run once more ahead "
                         "of the flush, untimed: the timed ones not their pipelines' first dispatch in the "
                         "submission, as SDPA's kernels are not their first launch; Attention.recording)")
    ap.add_argument("--tune-flush-mib", type=int, default=0,
                    help="the tuner reads this many MiB ahead of every candidate it times, pushing the L2's "
                         "contents out as the timed calls' flush does (attend_tune.FLUSH_BYTES; 0: back to back)")
    ap.add_argument("--codes", type=Path, default=None,
                    help="an .npz of captured code words (k_codes, v_codes, n_atoms: docs/results/captured_codes_gpl3.npz) for the dict "
                         "slots, tiled over tokens and KV heads, in place of uniformly random ones")
    args = common.parse(ap, argv)
    try:
        args.code_words = load_codes(args.codes, args.n_atoms, args.sparsity) if args.codes else None
    except (OSError, KeyError, ValueError) as e:  # unreadable, not a capture, or not this run's format
        ap.error(f"--codes: {e}")
    args.shape_list = [common.dims(s) for s in args.shapes.split(",")] \
        if args.shapes else [(args.n_kv, args.gqa)]
    args.head_dim_list = [int(x) for x in args.head_dims.split(",")] if args.head_dims else [args.head_dim]
    args.n_used_list = [int(x) for x in args.n_used.split(",")]
    args.format_list = [tuple(int(b) for b in f.split("/")) for f in args.formats.split(",") if f.strip()]
    args.batch_list = [int(x) for x in args.batches.split(",") if x.strip()]
    args.exact_window = None
    if args.window:
        from kvdict_vk.window import ExactWindow
        args.exact_window = ExactWindow(*(int(x) for x in args.window.split("/")))
    if any(b < 1 for b in args.batch_list) or args.batch_n_used < 1:
        ap.error("--batches and --batch-n-used take positive integers")
    return args


def read_codes(path) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """A capture of code words (docs/results/captured_codes_gpl3.npz): ((K, V) code words, each
    (streams, tokens, s) uint32, and the atom count of the dictionaries they index)."""
    with np.load(path) as f:
        return tuple(f[k].astype(np.uint32) for k in ("k_codes", "v_codes")), int(f["n_atoms"])


def load_codes(path: Path, n_atoms: int, sparsity: int) -> tuple[np.ndarray, np.ndarray]:
    """--codes: the captured (K, V) code words (read_codes), checked against the benchmark's
    dictionaries (the same atom count and code words a slot)."""
    codes, captured_atoms = read_codes(path)
    if captured_atoms != n_atoms or any(c.ndim != 3 or c.shape[2] != sparsity for c in codes):
        raise ValueError(f"{path}: code words of {captured_atoms} atoms, shaped (K) {codes[0].shape} / (V) "
                         f"{codes[1].shape}; this run's dictionaries have {n_atoms} atoms, {sparsity} a slot "
                         f"(--n-atoms, --sparsity)")
    return codes


def dict_args(preset: str = "gpu", code_words=None):
    """The dictionary settings dict_arena takes (per_head, n_atoms, sparsity) as ``preset``
    runs them, with ``code_words`` (None: uniform) — for probes timing what the benchmark times."""
    a = parse_args(PRESETS[preset])
    a.code_words = code_words
    return a


def _arenas(n_kv, hd, args, dev, rng) -> dict:
    """{mode family: arena}: f16, f32, q8_0 (the same rows) and one dict arena per format."""
    from kvdict_vk.vk import KvArena
    n_ctx = max(args.n_used_list)
    rows = [random_rows(rng, n_kv, n_ctx, hd) for _ in "kv"]
    arenas = {}
    for cache in UNCODED + (KIVI,):
        arenas[cache] = KvArena(1, n_kv, hd, n_ctx, device=dev, cache=cache)
        arenas[cache].append(0, *rows)
    del rows
    for bits in args.format_list:
        arenas[format_name(bits)] = dict_arena(bits, n_kv, hd, n_ctx, args, dev, rng)[0]
        if args.exact_window:
            arenas[window_format(bits, args)] = dict_arena(bits, n_kv, hd, n_ctx, args, dev, rng,
                                                           window=args.exact_window)[0]
        if args.key_rope:
            from kvdict_vk.rope import KeyRope
            arenas[rope_format(bits)] = dict_arena(bits, n_kv, hd, n_ctx, args, dev, rng,
                                                   key_rope=KeyRope(10000.0, hd))[0]
    return arenas


def rope_format(bits) -> str:
    """A dict format with --key-rope: its rows' ``format``."""
    return f"{format_name(bits)}+keys_before_rope"


def window_format(bits, args) -> str:
    """A dict format with --window's exact window: its rows' ``format``."""
    return f"{format_name(bits)}+sink{args.exact_window.sink}+recent{args.exact_window.recent}"


def _modes(arenas, args, n_heads: int) -> dict:
    """{mode: (arena, cache, format, forced path or None, reconstruct?)}. An uncoded cache
    whose engine picks another path than attend_direct (attend_flash on GPUs) also gets
    attend_direct forced, beside it."""
    modes = {}
    for c in UNCODED:
        modes[f"{c}_cache"] = (arenas[c], c, None, None, False)
        if c != "q8_0" and not args.engine_paths_only \
                and arenas[c].attention(n_heads).plan(0, args.n_used_list[0]).path != "direct":
            modes[f"{c}_cache_direct"] = (arenas[c], c, None, "direct", False)
    # the KIVI cache: attend_flash_kivi over its words, and its read-out path (rows) beside it
    modes["kivi_cache"] = (arenas[KIVI], KIVI, None, None, False)
    if not args.engine_paths_only:
        modes["kivi_cache_rows"] = (arenas[KIVI], KIVI, None, "rows", True)
    for bits in args.format_list:
        f = format_name(bits)
        modes[f"dict_{f}"] = (arenas[f], "dict", f, None, False)
        if not args.engine_paths_only:
            modes[f"dict_{f}_direct"] = (arenas[f], "dict", f, "direct", False)
            modes[f"dict_{f}_table"] = (arenas[f], "dict", f, "table", False)
        if not args.no_reconstruct:
            modes[f"recon_{f}"] = (arenas[f], "dict", f, None, True)
        if args.exact_window:
            modes[f"dict_{f}_window"] = (arenas[window_format(bits, args)], "dict", window_format(bits, args), None,
                                         False)
        if args.key_rope:
            modes[f"dict_{f}_key_rope"] = (arenas[rope_format(bits)], "dict", rope_format(bits), None, False)
    return modes


def _nmse(a, b) -> float:
    return float(np.sum((a.astype(np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def bench_n_used(n, modes, q, anchor, shape, args, roof) -> dict:
    n_kv, gqa, hd = shape
    scale = 1.0 / np.sqrt(hd)
    candidates, info, made = {}, {}, []
    f32_att = modes["f32_cache"][0].attention(q.shape[0])
    try:
        for mode, (arena, cache, fmt, path, recon) in modes.items():
            att = arena.attention(q.shape[0])
            if recon:
                candidates[mode] = lambda att=att: att.attend_reconstructed(0, q, n, scale)
                # the f32 kernels over the rows: what the f32 engine plans on its direct path
                moved = traffic.bytes_moved("reconstruct_then_attend", arena.layout, 0, n,
                                            plan=f32_att.plan(0, n, path="direct"), n_heads=q.shape[0])
                plan = {"path": "reconstruct_then_attend"}
            else:
                rec = att.recording(0, q, n, scale, path=path, timestamps=True, **our_recording_args(args, anchor))
                made.append(rec)
                candidates[mode] = rec
                p = att.plan(0, n, path=path)
                moved = traffic.bytes_moved("attend", arena.layout, 0, n, plan=p, n_heads=q.shape[0])
                plan = {"path": p.path, "n_splits": p.n_splits, "split_len": p.split_len, "variant": att.variant(0, p),
                        **({"local": p.local, "heads": p.heads} if p.path == "flash" else {}),
                        **({"kernel": p.kernel} if p.path == "flash" else {})}
            info[mode] = {"cache": cache, "format": fmt, "forced": path, "plan": plan, "bytes": moved}
        outputs = {}
        for mode, c in candidates.items():  # warm-up, and what each mode computes
            if timing.is_recording(c):
                c.run()
                outputs[mode] = modes[mode][0].attention(q.shape[0]).output()
            else:
                outputs[mode] = c()
        checks = {"f16_vs_f32_nmse": _nmse(outputs["f16_cache"], outputs["f32_cache"]),
                  "q8_0_vs_f32_nmse": _nmse(outputs["q8_0_cache"], outputs["f32_cache"]),
                  "kivi_vs_f32_nmse": _nmse(outputs["kivi_cache"], outputs["f32_cache"])}
        if "kivi_cache_rows" in outputs:
            checks["kivi_cache_rows_vs_kivi_cache_nmse"] = _nmse(outputs["kivi_cache_rows"], outputs["kivi_cache"])
        for c in UNCODED:
            if f"{c}_cache_direct" in outputs:
                checks[f"{c}_cache_direct_vs_{c}_cache_nmse"] = _nmse(outputs[f"{c}_cache_direct"], outputs[f"{c}_cache"])
        for bits in args.format_list:
            f = format_name(bits)
            for m in (f"dict_{f}_direct", f"dict_{f}_table", f"recon_{f}"):
                if m in outputs:
                    checks[f"{m}_vs_dict_{f}_nmse"] = _nmse(outputs[m], outputs[f"dict_{f}"])
        times = timing.measure(candidates, args.repeats, budget_s=args.case_budget_s,
                               warm_s=timing.warm_for(f32_att.device), before=flush_before(candidates, args, anchor))
    finally:
        for rec in made:
            rec.free()
    torch_s = anchor.seconds(n_kv, gqa, hd, n)
    out = {"n_used": n, "repeats": len(next(iter(times.values()))["wall"]["samples"]), "checks": checks,
           "torch_sdpa_f16_s": torch_s, "modes": {}}
    for mode, t in times.items():
        out["modes"][mode] = {**info[mode], "seconds": t,
                              "roofline_fraction": roofline.fraction(info[mode]["bytes"]["total"], t, roof)}
    return out


def case_name(mode_info, shape, n) -> str:
    n_kv, gqa, hd = shape
    if mode_info["cache"] in UNCODED + (KIVI,):
        what = mode_info["cache"] + (f" {mode_info['forced']}" if mode_info["forced"] else "")
    elif mode_info["plan"]["path"] == "reconstruct_then_attend":
        what = f"recon {mode_info['format']}"
    else:
        what = f"dict {mode_info['format']}" + (f" {mode_info['forced']}" if mode_info["forced"] else "")
    return f"{what} {results.shape_case(n_kv, gqa, hd, n)}"


def _launch(plan: dict) -> dict:
    """A flash row's launch shape, as its tuner chose it (the kernel's build, invocations and
    query heads per workgroup, splits): what a row's time depends on besides its bytes."""
    return {k: plan[k] for k in ("variant", "kernel", "local", "heads", "n_splits") if k in plan}


def make_rows(result) -> list[dict]:
    kind = "cpu" if result["device"]["device_type"] == "cpu" else "gpu"
    rows = []
    for case in result["cases"]:
        shape = (case["n_kv"], case["gqa"], case["head_dim"])
        for r in case["by_n_used"] + case.get("by_batch", []):
            batch = r.get("batch", 1)
            for mode, m in r["modes"].items():
                name = case_name(m, shape, r["n_used"]) + (f" b{batch}" if "batch" in r else "")
                rows.append(results.row(
                    NAME, name, m["seconds"], cache=m["cache"], n_used=r["n_used"], batch=batch,
                    n_kv=shape[0], gqa=shape[1], head_dim=shape[2], moved=m["bytes"], roofline=result["roofline"],
                    torch_sdpa_f16_s=r["torch_sdpa_f16_s"], mode=mode, path=m["plan"]["path"], format=m["format"],
                    device_kind=kind, **_launch(m["plan"]),
                    **({"default": True} if m["cache"] == "dict" and m["format"] == DEFAULT_FORMAT else {})))
    return rows


def run(args, progress) -> dict:
    from kvdict_vk.vk.attend import tune as attend_tune
    flush_before, attend_tune.FLUSH_BYTES = attend_tune.FLUSH_BYTES, args.tune_flush_mib << 20
    try:
        return _run(args, progress)
    finally:
        attend_tune.FLUSH_BYTES = flush_before


def _run(args, progress) -> dict:
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    t0 = time.time()
    roof = roofline.measure(dev)
    anchor = torch_anchor.Anchor(args.sdpa_calls, enabled=not args.no_sdpa, flush_bytes=args.l2_flush_mib << 20)
    progress(f"{dev.name}: roofline {roof['bytes_per_s'] / 1e9:.2f} GB/s; SDPA anchor: "
             f"{'torch ' + anchor.info['torch'] if anchor.info else anchor.note}")
    cases = []
    for n_kv, gqa in args.shape_list:
        for hd in args.head_dim_list:
            shape = (n_kv, gqa, hd)
            arenas = _arenas(n_kv, hd, args, dev, rng)
            try:
                q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
                modes = _modes(arenas, args, q.shape[0])
                by_n = []
                for n in args.n_used_list:
                    by_n.append(bench_n_used(n, modes, q, anchor, shape, args, roof))
                    m = by_n[-1]["modes"]
                    progress(f"{n_kv}x{gqa} d{hd} n_used {n}: " + ", ".join(
                        f"{k} {1e3 * timing.best_seconds(v['seconds']):.3f} ms" for k, v in m.items()
                        if v["cache"] in UNCODED or not (v["forced"] or k.startswith("recon"))))
            finally:
                for a in arenas.values():
                    a.free()
            by_batch = []
            for batch in args.batch_list:
                by_batch.append(attention_batch.bench_batch(batch, shape, args, dev, rng, anchor, roof))
                progress(f"{n_kv}x{gqa} d{hd} batch {batch} × {args.batch_n_used}: " + ", ".join(
                    f"{k} {1e3 * timing.best_seconds(v['seconds']):.3f} ms" for k, v in by_batch[-1]["modes"].items())
                    + f" (SDPA {1e3 * (by_batch[-1]['torch_sdpa_f16_s'] or float('nan')):.3f} ms)")
            cases.append({"n_kv": n_kv, "gqa": gqa, "head_dim": hd, "by_n_used": by_n, "by_batch": by_batch})
    result = {**common.run_header(TOOL, args, dev, t0),
              "config": {**{k: getattr(args, k) for k in ("sparsity", "n_atoms", "per_head", "repeats", "formats",
                                                          "window", "key_rope", "case_budget_s")},
                         "codes": str(args.codes) if args.codes else "uniform",
                         "tune_flush_mib": args.tune_flush_mib, "our_flush": args.our_flush},
              "timing": "Attention.recording (query upload, passes, read-back; with our_flush 'submission' the "
                        "L2 flush right before the passes, in the same submission; 'primed': the passes once "
                        "more ahead of the flush, untimed) run per repeat: GPU time from timestamps around "
                        "the passes, wall time around submit + wait; recon_*: KvArena's two submissions, wall",
              "roofline": roof, "sdpa": anchor.to_dict(), "cases": cases}
    result["rows"] = make_rows(result)
    return result


def rows(result) -> list[dict]:
    return result["rows"]


def notes(result) -> list[str]:
    """What summary.json should say about this run's columns."""
    sd = result["sdpa"]
    return [] if sd["available"] and not sd["note"] else [f"torch_sdpa_f16_s: {sd['note']}"]


def headline(result) -> list[dict]:
    """dict-coded (the path KvArena.attend picks) / f16-cache time per decode step, per
    case and format: GPU time where the device has timestamps, else wall time."""
    figures = []
    for case in result["cases"]:
        for r in case["by_n_used"]:
            f16 = r["modes"]["f16_cache"]["seconds"]
            for mode, m in r["modes"].items():
                if m["cache"] != "dict" or m["forced"] or m["plan"]["path"] == "reconstruct_then_attend":
                    continue
                num, den = timing.best_seconds(m["seconds"]), timing.best_seconds(f16)
                figures.append({"figure": f"dict {m['format']} / f16 cache time",
                                "case": results.shape_case(case["n_kv"], case["gqa"], case["head_dim"], r["n_used"]),
                                "numerator": num, "denominator": den, "unit": "s", "ratio": num / den})
    return figures


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: per decode step, median ms (GPU time where there are timestamps, "
             f"else wall); roofline {result['roofline']['bytes_per_s'] / 1e9:.2f} GB/s"]
    sd = result["sdpa"]
    flush = (sd.get("info") or {}).get("l2_flush_bytes")
    lines.append(f"  torch SDPA anchor: {'available' if sd['available'] else sd['note']}"
                 + (f"; the L2 flushed before every timed call, ours and SDPA's ({flush >> 20} MiB read)"
                    if flush else "; no L2 flush between calls" if sd["available"] else ""))
    for case in result["cases"]:
        for r in case["by_n_used"]:
            lines.append(f"  {case['n_kv']}x{case['gqa']} d{case['head_dim']} n_used {r['n_used']}:"
                         + (f"  (torch SDPA {1e3 * r['torch_sdpa_f16_s']:.3f} ms)" if r["torch_sdpa_f16_s"] else ""))
            for mode, m in r["modes"].items():
                frac = m["roofline_fraction"]
                lines.append(f"    {mode:20s} {1e3 * timing.best_seconds(m['seconds']):9.3f} ms  "
                             f"wall {1e3 * m['seconds']['wall_s']:9.3f} ms  {m['bytes']['total'] / 2**20:8.2f} MiB"
                             + (f"  {frac:6.3f} of roofline" if frac is not None else ""))
        for r in case.get("by_batch", []):
            sdpa = r["torch_sdpa_f16_s"]
            lines.append(f"  {case['n_kv']}x{case['gqa']} d{case['head_dim']} batch {r['batch']} × {r['n_used']}:"
                         + (f"  (torch SDPA {1e3 * sdpa:.3f} ms)" if sdpa else ""))
            for mode, m in r["modes"].items():
                t = timing.best_seconds(m["seconds"])
                lines.append(f"    {mode:20s} {1e3 * t:9.3f} ms" + (f"  {t / sdpa:6.2f}× SDPA" if sdpa else ""))
    return lines


def plot(plt, result):
    cases = result["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows = case["by_n_used"]
        modes = list(rows[0]["modes"])
        x = np.arange(len(rows))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            med = [1e3 * timing.best_seconds(r["modes"][mode]["seconds"]) for r in rows]
            ax.bar(x + (i - (len(modes) - 1) / 2) * width, med, width, label=mode.replace("_", " "))
        sd = [r["torch_sdpa_f16_s"] for r in rows]
        if all(s is not None for s in sd):
            ax.plot(x, [1e3 * s for s in sd], "k_", markersize=30, label="torch SDPA f16")
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{r['n_used']} tokens" for r in rows])
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title(f"{case['n_kv']} KV heads × GQA {case['gqa']}, head_dim {case['head_dim']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['device']['name']}: decode attention (GPU time where available)", fontsize=10)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
