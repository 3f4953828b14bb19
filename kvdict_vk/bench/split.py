"""A model's greedy decode over an arena split by layers across devices, against one device
(issue 53): tokens/s, each device's GPU time, the host's share (wall − the devices' GPU time,
the residual stream's hand-over included), each device's arena and weights, and the longest
context whose arena and weights fit one device against the split.

The model has random weights of a given shape (Q4_1 matrices, a Q8_0 embedding:
weights.random_weights): ``smollm2`` (SmolLM2-135M's shapes) or ``wide`` (32 layers of 8 KV heads
× 128: the shape issue 53 opens with, hidden 1024, a 32 000-token vocabulary; ``tiny``: 3 layers,
for a smoke test). Each arena holds
the context's random K/V rows (bench.decode_step.fill_random) and room for the timed tokens.
The split runs on ``--devices`` devices: the first ones ``KVDICT_VK_DEVICE`` names, or logical
devices of one (``--logical``: two Kompute managers of one GPU — the hand-over's cost, not more
memory or bandwidth). "Fits" is arithmetic: the layouts' bytes (memory_report.build) plus the
weights against each device's largest device-local heap (logical devices: as if each had the
heap of the one they share).

    python -m kvdict_vk.bench.split [--model smollm2|wide] [--contexts 8192,131072] [--devices 2]
        [--logical] [--caches f16,q8_0,dict] [--tokens 16] [--out out/bench_split.json]
"""
from __future__ import annotations

import contextlib
import dataclasses
import shlex
import time

import numpy as np

from . import common
from .decode_step import fill_random
from .generate import WARM_S, WARM_TOKENS, dict_artifact, smollm2_shapes

NAME, TOOL = "split", "kvdict_vk.bench.split"


def model_shapes(name: str):
    if name == "smollm2":
        return smollm2_shapes()
    if name == "tiny":  # a smoke test's
        return dataclasses.replace(smollm2_shapes(), n_layers=3, hidden=96, n_heads=6, n_kv_heads=3, head_dim=32,
                                   ffn=160, rope_dim=32, vocab=300)
    if name == "wide":
        return dataclasses.replace(smollm2_shapes(), n_layers=32, hidden=1024, n_heads=32, n_kv_heads=8,
                                   head_dim=128, ffn=2816, rope_dim=128, vocab=32000, tied=False)
    raise SystemExit(f"--model: smollm2, wide or tiny, not {name!r}")


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=1)
    ap.add_argument("--model", default="smollm2", help="smollm2, wide or tiny (random weights of that shape)")
    ap.add_argument("--contexts", default="8192,131072", help="tokens in the cache before the timed tokens")
    ap.add_argument("--caches", default="f16,q8_0,dict", help="f16, q8_0, kivi, dict (the forge's default format)")
    ap.add_argument("--devices", type=int, default=2, help="devices the split spans")
    ap.add_argument("--logical", action="store_true", help="logical devices of the one device (open_devices)")
    ap.add_argument("--tokens", type=int, default=16, help="timed tokens per case")
    return common.parse(ap, argv)


def _devices(args, dev) -> list:
    from kvdict_vk.vk.device import get_device, list_devices
    from kvdict_vk.vk.split import open_devices
    if args.logical:
        return open_devices(dev.info.index, args.devices)
    same = [d.index for d in list_devices() if d.name == dev.name]
    if len(same) < args.devices:
        raise SystemExit(f"{len(same)} device(s) named {dev.name!r}, {args.devices} asked (--logical for "
                         f"logical devices of one)")
    return [dev] + [get_device(i) for i in same if i != dev.info.index][:args.devices - 1]


def _timed(forward, tokens: int, progress, label: str) -> dict:
    token, t0, warm = 1, time.perf_counter(), 0
    while warm < WARM_TOKENS and (warm < 2 or time.perf_counter() - t0 < WARM_S):
        token, warm = forward.run(token), warm + 1
    wall, gpu = [], []
    for i in range(tokens):
        t = time.perf_counter()
        token = forward.run(token)
        wall.append(time.perf_counter() - t)
        g = forward.gpu_seconds()
        gpu.append(g if isinstance(g, list) else [g])
        progress(f"{label}: token {i + 1}/{tokens}")
    gpu = np.array(gpu, dtype=float)  # (tokens, devices)
    return {"tokens_per_s": 1.0 / float(np.median(wall)), "wall_s": common.stats(wall),
            "gpu_us_per_token": [1e6 * float(x) for x in np.median(gpu, axis=0)],
            "host_us_per_token": 1e6 * float(np.median(np.subtract(wall, gpu.sum(axis=1))))}


def fits(cfg, cache: str, art, n_layers: int, weight_bytes: int, heap: int) -> int:
    """The longest context (a multiple of 1 024) whose arena of ``n_layers`` layers of ``cache``
    (dict: ``art``'s first ``n_layers``) and ``weight_bytes`` of weights fit ``heap`` bytes."""
    from kvdict_vk import kivi
    from kvdict_vk import memory_report as M
    from kvdict_vk.vk.split import artifact_part
    desc = {"dict": lambda: artifact_part(art, (0, n_layers)), "kivi": kivi.KiviSpec}.get(cache, lambda: cache)()
    lo, hi = 0, 1 << 26
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024 or 1024
        if M.build(n_layers, cfg.n_kv_heads, cfg.head_dim, mid, desc).total_bytes + weight_bytes <= heap:
            lo = mid
        else:
            hi = mid
    return lo


def run(args, progress) -> dict:
    from kvdict_vk import runtime
    from kvdict_vk.vk import KvArena
    from kvdict_vk.vk.forward import DeviceForward, SplitForward, random_weights
    from kvdict_vk.vk.split import SplitArena
    dev = common.open_device(args)
    t0 = time.time()
    cfg = model_shapes(args.model)
    weights = random_weights(cfg, np.random.default_rng(0), "q4_1", embedding="q8_0")
    devices = _devices(args, dev)
    command = "python -m " + TOOL + " " + shlex.join(args.argv)
    rows = []
    for cache in (c.strip() for c in args.caches.split(",") if c.strip()):
        for depth in (int(c) for c in args.contexts.split(",") if c.strip()):
            rng = np.random.default_rng(1)
            capacity = depth + args.tokens + WARM_TOKENS
            art = dict_artifact(cfg, rng) if cache == "dict" else None
            for n_dev in (1, len(devices)):
                with runtime.enabled_with(art, allow_uncertified=True) if art else contextlib.nullcontext():
                    arena = (KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, device=devices[0],
                                     cache=cache)
                             if n_dev == 1 else SplitArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity,
                                                           devices, split="layer", cache=cache))
                try:
                    parts = [arena] if n_dev == 1 else [p.arena for p in arena.parts]
                    for a in parts:
                        fill_random(a, rng, depth)
                    forward = (DeviceForward(weights, arena, timestamps=True) if n_dev == 1
                               else SplitForward(weights, arena, timestamps=True))
                    with forward:
                        row = _timed(forward, args.tokens, progress, f"{cache} {depth} on {n_dev}")
                        wb = [forward.weight_bytes] if n_dev == 1 else forward.weight_bytes
                    heaps = [d.info.device_local_bytes for d in devices[:n_dev]]
                    layers = [cfg.n_layers] if n_dev == 1 else [p.layers[1] - p.layers[0] for p in arena.parts]
                    rows.append({"cache": cache, "n_ctx": depth, "devices": n_dev, "split": "layer" if n_dev > 1
                                 else None, **row,
                                 "arena_bytes": [a.layout.total_bytes for a in parts],
                                 "tail_bytes": [a.layout.tail_bytes for a in parts], "weight_bytes": wb,
                                 "largest_ctx": min(fits(cfg, cache, art, n, w, h) for n, w, h in zip(layers, wb, heaps)),
                                 "device_names": [d.name for d in devices[:n_dev]], "logical": args.logical,
                                 "command": command})
                finally:
                    arena.free()
    return {**common.run_header(TOOL, args, dev, t0), "model": {"shape": args.model, "config": vars(cfg)},
            "config": {"contexts": args.contexts, "caches": args.caches, "tokens": args.tokens,
                       "devices": args.devices, "logical": args.logical}, "rows": rows}


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: greedy decode over a layer split ({result['model']['shape']} shapes)"]
    for r in result["rows"]:
        gpu = " + ".join(f"{g:.0f}" for g in r["gpu_us_per_token"])
        lines.append(f"  {r['cache']:5s} {r['n_ctx']:7d} on {r['devices']}: {r['tokens_per_s']:8.1f} tok/s  GPU {gpu} µs"
                     f"  host {r['host_us_per_token']:7.1f} µs  arena "
                     + " + ".join(f"{b / 2**20:.0f}" for b in r["arena_bytes"])
                     + f" MiB  fits {r['largest_ctx']} tokens")
    return lines


def plot(plt, result):
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for cache in sorted({r["cache"] for r in rows}):
        for n_dev, marker in ((1, "o"), (result["config"]["devices"], "s")):
            pts = sorted((r["n_ctx"], r["tokens_per_s"]) for r in rows if r["cache"] == cache and r["devices"] == n_dev)
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=f"{cache} on {n_dev}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"decode over a layer split, {result['device']['name']}")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
