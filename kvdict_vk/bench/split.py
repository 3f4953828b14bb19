"""A model's greedy decode over an arena split across devices (issue 53), by layers or by KV
heads, against one device: tokens/s, each device's GPU time, the host's share (wall − the
devices' GPU time: the hand-overs included), each device's arena and weights, and the longest
context whose arena and weights fit one device against the split.

The model has random weights of a given shape (Q4_1 matrices, a Q8_0 embedding:
weights.random_weights): ``smollm2`` (SmolLM2-135M's shapes), ``wide`` (32 layers of 8 KV heads
× 128: the shape issue 53 opens with, hidden 1024, a 32 000-token vocabulary) or ``tiny`` (3
layers, for a smoke test). Each arena holds the context's random K/V rows
(bench.decode_step.fill_random) and room for the timed tokens. The split runs on ``--devices``
devices: the first ones ``KVDICT_VK_DEVICE`` names, or logical devices of one (``--logical``:
two Kompute managers of one GPU — the hand-over's cost, not more memory or bandwidth); or, with
``--ranks N``, on N torch.distributed ranks (gloo), a process each, all on the one device.
"Fits" is arithmetic: the layouts' bytes (memory_report.build) plus the weights against each
device's largest device-local heap (logical devices and ranks: as if each had the heap of the
one they share).

    python -m kvdict_vk.bench.split [--model smollm2|wide|tiny] [--contexts 8192,131072]
        [--split layer|head] [--devices 2 [--logical] | --ranks 2] [--caches f16,q8_0,dict]
        [--tokens 16] [--out out/bench_split.json]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import tempfile
import time
from pathlib import Path

import numpy as np

from . import common
from .decode_step import fill_random
from .generate import WARM_TOKENS, decode_samples, dict_artifact, smollm2_shapes, tokens_per_s_plot

NAME, TOOL = "split", "kvdict_vk.bench.split"


def model_shapes(name: str):
    if name == "smollm2":
        return smollm2_shapes()
    if name == "tiny":  # a smoke test's
        return dataclasses.replace(smollm2_shapes(), n_layers=3, hidden=96, n_heads=6, n_kv_heads=3, head_dim=32,
                                   ffn=160, rope_dim=32, vocab=300)
    if name == "wide":
        return dataclasses.replace(smollm2_shapes(), n_layers=32, hidden=1024, n_heads=32, n_kv_heads=8,
                                   head_dim=128, ffn=2816, rope_dim=128, vocab=32000, tied_output=False)
    raise SystemExit(f"--model: smollm2, wide or tiny, not {name!r}")


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=1)
    ap.add_argument("--model", default="smollm2", help="smollm2, wide or tiny (random weights of that shape)")
    ap.add_argument("--contexts", default="8192,131072", help="tokens in the cache before the timed tokens")
    ap.add_argument("--caches", default="f16,q8_0,dict", help="f16, q8_0, kivi, dict (the forge's default format)")
    ap.add_argument("--devices", type=int, default=2, help="devices the split spans")
    ap.add_argument("--logical", action="store_true", help="logical devices of the one device (open_devices)")
    ap.add_argument("--tokens", type=int, default=16, help="timed tokens per case")
    ap.add_argument("--split", default="layer", choices=("layer", "head"), help="by layers or by KV heads")
    ap.add_argument("--ranks", type=int, default=0, help="the split over this many torch.distributed ranks "
                    "(gloo; a process each, every one on the device --device names) instead of one process")
    ap.add_argument("--rank-case", default=None, help=argparse.SUPPRESS)
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


def _timed(forward, tokens: int, progress, label: str, exchange=None, agree=bool, concurrent=False) -> dict:
    """Wall and GPU time per token (bench.generate.decode_samples, its ``exchange`` and
    ``agree``); host time is wall less the GPU time of the devices held here — their sum, or
    where they run at once (``concurrent``: a head split's) the longest."""
    samples = decode_samples(forward, tokens, progress, label, exchange, agree)
    wall, swap = samples["wall"], samples["exchange"]
    gpu = np.array([g if isinstance(g, list) else [g] for g in samples["gpu"]], dtype=float)  # (tokens, devices)
    row = {"tokens_per_s": 1.0 / float(np.median(wall)), "wall_s": common.stats(wall),
           "gpu_us_per_token": [1e6 * float(x) for x in np.median(gpu, axis=0)],
           "host_us_per_token": 1e6 * float(np.median(np.subtract(wall, gpu.max(axis=1) if concurrent
                                                                   else gpu.sum(axis=1))))}
    if exchange:
        row["exchange_us_per_token"] = 1e6 * float(np.median(swap))
    return row


def rank_case(spec: dict) -> None:
    """One rank of ``--ranks``: its part of a RankArena over a gloo group (split as spec["split"]),
    the model's decode over it (SplitForward), timed; rank 0 writes every rank's figures to
    spec["out"]."""
    import json
    import torch.distributed as dist
    from kvdict_vk import runtime
    from kvdict_vk.vk.device import get_device
    from kvdict_vk.vk.forward import SplitForward, random_weights
    from kvdict_vk.vk.ranks import RankArena
    os.environ["VK_LOADER_LAYERS_DISABLE"] = "VK_LAYER_KHRONOS_validation"  # as common.open_device
    dist.init_process_group("gloo", init_method="file://" + spec["init"], rank=spec["rank"],
                            world_size=spec["world"])
    cfg = model_shapes(spec["model"])
    weights = random_weights(cfg, np.random.default_rng(0), "q4_1", embedding="q8_0")
    rng = np.random.default_rng(1)
    art = dict_artifact(cfg, rng) if spec["cache"] == "dict" else None
    with runtime.enabled_with(art, allow_uncertified=True) if art else contextlib.nullcontext():
        arena = RankArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, spec["capacity"], get_device(spec["device"]),
                          split=spec["split"], cache=spec["cache"])
    with arena:
        fill_random(arena.part.arena, rng, spec["depth"])
        with SplitForward(weights, arena, timestamps=True) as fw:
            def agree(more: bool) -> bool:
                box = [more]
                dist.broadcast_object_list(box, src=0)
                return box[0]
            row = _timed(fw, spec["tokens"], lambda _: None, "", exchange=lambda: arena.exchange_s, agree=agree)
            row.update(arena_bytes=arena.part.arena.layout.total_bytes, tail_bytes=arena.part.arena.layout.tail_bytes,
                       weight_bytes=fw.weight_bytes[0],
                       shape=[arena.part.arena.layout.n_layers, arena.part.arena.layout.n_kv_heads])
        rows = [None] * spec["world"]
        dist.all_gather_object(rows, row)
    if spec["rank"] == 0:
        Path(spec["out"]).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _over_ranks(args, cfg, cache: str, depth: int, capacity: int, device_name: str, tmp: Path) -> dict:
    """The split's row from ``args.ranks`` processes (rank_case each), all on ``device_name``."""
    import json
    import subprocess
    import sys
    procs = []
    for r in range(args.ranks):
        spec = dict(rank=r, world=args.ranks, init=str(tmp / f"init-{cache}-{depth}"), model=args.model, cache=cache,
                    split=args.split, depth=depth, capacity=capacity, tokens=args.tokens, device=device_name,
                    out=str(tmp / f"ranks-{cache}-{depth}.json"))
        procs.append(subprocess.Popen([sys.executable, "-m", TOOL, "--rank-case", json.dumps(spec)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for r, p in enumerate(procs):
        text = p.communicate(timeout=3600)[0]
        if p.returncode:
            raise SystemExit(f"rank {r} failed:\n{text[-3000:]}")
    rows = json.loads((tmp / f"ranks-{cache}-{depth}.json").read_text())
    return {"tokens_per_s": rows[0]["tokens_per_s"], "wall_s": rows[0]["wall_s"],
            "gpu_us_per_token": [r["gpu_us_per_token"][0] for r in rows],
            "host_us_per_token": [r["host_us_per_token"] for r in rows],
            "exchange_us_per_token": [r["exchange_us_per_token"] for r in rows],
            "arena_bytes": [r["arena_bytes"] for r in rows], "tail_bytes": [r["tail_bytes"] for r in rows],
            "weight_bytes": [r["weight_bytes"] for r in rows], "shape": [r["shape"] for r in rows]}


def fits(cfg, cache: str, art, shape, weight_bytes: int, heap: int) -> int:
    """The longest context (a multiple of 1 024) whose arena of ``shape`` (layers, KV heads) of
    ``cache`` (dict: ``art`` cut to them) and ``weight_bytes`` of weights fit ``heap`` bytes."""
    from kvdict_vk import kivi
    from kvdict_vk import memory_report as M
    from kvdict_vk.vk.split import artifact_part
    n_layers, n_kv = shape
    desc = {"dict": lambda: artifact_part(art, (0, n_layers), (0, n_kv) if art.n_heads > 1 else None),
            "kivi": kivi.KiviSpec}.get(cache, lambda: cache)()
    lo, hi = 0, 1 << 26
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024 or 1024
        if M.build(n_layers, n_kv, cfg.head_dim, mid, desc).total_bytes + weight_bytes <= heap:
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
    n_split = args.ranks or args.devices
    devices = [dev] * n_split if args.ranks else _devices(args, dev)
    command = "python -m " + TOOL + " " + shlex.join(args.argv)
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="kvdict-split-"))
    for cache in (c.strip() for c in args.caches.split(",") if c.strip()):
        for depth in (int(c) for c in args.contexts.split(",") if c.strip()):
            capacity = depth + args.tokens + WARM_TOKENS
            for n_dev in (1, n_split):
                rng = np.random.default_rng(1)
                art = dict_artifact(cfg, rng) if cache == "dict" else None
                progress(f"{cache} {depth} on {n_dev}")
                if n_dev > 1 and args.ranks:
                    row = _over_ranks(args, cfg, cache, depth, capacity, dev.name, tmp)
                    shapes = row.pop("shape")
                else:
                    with runtime.enabled_with(art, allow_uncertified=True) if art else contextlib.nullcontext():
                        arena = (KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, device=devices[0],
                                         cache=cache) if n_dev == 1 else
                                 SplitArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, devices,
                                            split=args.split, cache=cache))
                    try:
                        parts = [arena] if n_dev == 1 else [p.arena for p in arena.parts]
                        for a in parts:
                            fill_random(a, rng, depth)
                        forward = (DeviceForward(weights, arena, timestamps=True) if n_dev == 1
                                   else SplitForward(weights, arena, timestamps=True))
                        with forward:
                            row = _timed(forward, args.tokens, progress, f"{cache} {depth} on {n_dev}",
                                         concurrent=n_dev > 1 and args.split == "head")
                            row.update(weight_bytes=[forward.weight_bytes] if n_dev == 1 else forward.weight_bytes,
                                       arena_bytes=[a.layout.total_bytes for a in parts],
                                       tail_bytes=[a.layout.tail_bytes for a in parts])
                        shapes = [(a.layout.n_layers, a.layout.n_kv_heads) for a in parts]
                    finally:
                        arena.free()
                heaps = [d.info.device_local_bytes for d in devices[:n_dev]]
                rows.append({"cache": cache, "n_ctx": depth, "devices": n_dev,
                             "split": None if n_dev == 1 else args.split, "ranks": bool(args.ranks and n_dev > 1),
                             **row, "largest_ctx": min(fits(cfg, cache, art, sh, w, h)
                                                       for sh, w, h in zip(shapes, row["weight_bytes"], heaps)),
                             "device_names": [d.name for d in devices[:n_dev]],
                             "logical": bool(args.logical or args.ranks), "command": command})
    return {**common.run_header(TOOL, args, dev, t0), "model": {"shape": args.model, "config": vars(cfg)},
            "config": {"contexts": args.contexts, "caches": args.caches, "tokens": args.tokens,
                       "devices": n_split, "logical": args.logical, "ranks": args.ranks}, "rows": rows}


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: greedy decode over a {_split_of(result)} split "
             f"({result['model']['shape']} shapes)"]
    for r in result["rows"]:
        gpu = " + ".join(f"{g:.0f}" for g in r["gpu_us_per_token"])
        host = r["host_us_per_token"] if isinstance(r["host_us_per_token"], list) else [r["host_us_per_token"]]
        swap = f"  exchange {' + '.join(f'{x:.0f}' for x in r['exchange_us_per_token'])} µs" \
            if "exchange_us_per_token" in r else ""
        lines.append(f"  {r['cache']:5s} {r['n_ctx']:7d} on {r['devices']}: {r['tokens_per_s']:8.1f} tok/s  GPU {gpu} µs"
                     f"  host {' + '.join(f'{h:.0f}' for h in host)} µs{swap}  arena "
                     + " + ".join(f"{b / 2**20:.0f}" for b in r["arena_bytes"])
                     + f" MiB  fits {r['largest_ctx']} tokens")
    return lines


def plot(plt, result):
    rows, n_split = result["rows"], result["config"]["devices"]
    series = [(f"{cache} on {n}", marker, [r for r in rows if r["cache"] == cache and r["devices"] == n])
              for cache in sorted({r["cache"] for r in rows}) for n, marker in ((1, "o"), (n_split, "s"))]
    return tokens_per_s_plot(plt, series, f"decode over a {_split_of(result)} split, {result['device']['name']}")


def _split_of(result) -> str:
    """The split a run's rows were over (by layers or by KV heads)."""
    return next((r["split"] for r in result["rows"] if r.get("split")), "layer")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_case:
        import json
        rank_case(json.loads(args.rank_case))
        return 0
    return common.standalone(NAME, args, run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
