"""Where a device forward's GPU time goes, and fwd_matvec's invocations a row.

Random weights of SmolLM2-135M's shapes (Q4_1 matrices, a Q8_0 embedding: the GGUF's formats),
an arena filled to ``--depth`` tokens (``--batch`` B: B sequences each, every step a token of each,
their matvecs ``--seq-tile`` sequences a workgroup). For each ``--row-threads`` value and each of
``--subgroups`` (1: the matvecs' _sg builds where they fit, 0: their shared-memory trees), a
DeviceForward's GPU time per token (median over ``--tokens``, after WARM_TOKENS of warm-up);
then, at the best, one token — its values staged as a run stages them, every layer attending over the
whole depth — recorded with a timestamp after every op, summed by
DeviceForward.op_labels (embedding, qkv, rope, append + attention, o, mlp, norms, lm head, argmax).
With $KVDICT_VK_SPV_DIR at another build's SPIR-V (``--label`` names it), the same for that build.

    [PROBE_WARM_TOKENS=N] [PROBE_QKV_APPENDS=0] python lab/probes/forward_profile.py [--depth 1024] [--cache f16|q8_0|kivi|dict] [--row-threads 4,8,16,32,64]
        [--subgroups 1,0] [--tokens 10] [--label NAME] [--flash-workgroups N] [--batch 1] [--seq-tile 1]
        [--out lab/results/<device>/forward_profile.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

WARM_TOKENS = int(os.environ.get("PROBE_WARM_TOKENS", 300))  # tokens before timing (fewer: a quick run)
QKV_APPENDS = os.environ.get("PROBE_QKV_APPENDS", "1") != "0"  # 0: the step's append_step on every layer


def main(argv=None) -> None:
    from kvdict_vk.bench.decode_step import fill_random
    from kvdict_vk.bench.generate import smollm2_shapes
    from kvdict_vk.vk import KvArena, get_device
    from kvdict_vk.vk.forward import DeviceForward, random_weights
    from kvdict_vk.vk.submit import Recording, ticks_to_seconds
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--cache", default="f16")
    ap.add_argument("--row-threads", default="4,8,16,32,64")
    ap.add_argument("--subgroups", default="1,0")
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--label", default="")
    ap.add_argument("--flash-workgroups", type=int, default=None,
                    help="the attention's workgroups (Attention.flash_workgroups; default: tuned)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (DeviceForward's batch)")
    ap.add_argument("--seq-tile", type=int, default=1, help="DeviceForward's seq_tile")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    B = a.batch
    names = _name_ops()
    dev = get_device(None)
    cfg = smollm2_shapes()
    weights = random_weights(cfg, np.random.default_rng(0), "q4_1", embedding="q8_0")
    configs = len(a.row_threads.split(",")) * len(a.subgroups.split(","))
    capacity = a.depth + (configs + 1) * (WARM_TOKENS + a.tokens + 4)
    if a.cache == "dict":  # random dictionaries in the forge's default format, as the generate benchmark's
        from kvdict_vk.bench.generate import _dict_arena
        arena = _dict_arena(dev, cfg, capacity, np.random.default_rng(2))
    else:
        arena = KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, device=dev, cache=a.cache, seqs=B)
    fill_random(arena, np.random.default_rng(1), a.depth, seqs=B)
    if a.flash_workgroups is not None:  # fixed, not tuned: the launch shape's workgroup count
        arena.attention(cfg.n_heads).flash_workgroups = a.flash_workgroups
    out = {"device": dev.name, "label": a.label, "qkv_appends": QKV_APPENDS, "depth": a.depth, "cache": a.cache,
           "batch": B, "seq_tile": a.seq_tile, "flash_workgroups": a.flash_workgroups, "row_threads_gpu_us": {},
           "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python lab/probes/forward_profile.py " + " ".join(argv or [])}
    best = None
    for rt in (int(x) for x in a.row_threads.split(",")):
        for sg in (bool(int(x)) for x in a.subgroups.split(",")):
            try:
                f = DeviceForward(weights, arena, qkv_appends=QKV_APPENDS, timestamps=True, row_threads=rt, subgroups=sg,
                                  n_plan=arena.memory.seq_ctx, batch=B, seq_tile=a.seq_tile)
            except Exception as e:  # noqa: BLE001 (a probe: a build without the _sg variants, a row too wide)
                print(f"row_threads {rt:2d} subgroups {int(sg)}: {e}")
                continue
            gpu, ones = [], np.ones(B, np.int64)
            for _ in range(WARM_TOKENS):  # the clocks up from idle first
                f.run_batch(ones)
            for _ in range(a.tokens):
                f.run_batch(ones)
                gpu.append(f.gpu_seconds())
            f.free()
            us = 1e6 * float(np.median(gpu))
            key = f"{rt}{'_sg' if sg else ''}"
            out["row_threads_gpu_us"][key] = us
            print(f"row_threads {key:5s}: GPU {us:8.1f} µs a token")
            if best is None or us < best[0]:
                best = (us, rt, sg, key)
    f = DeviceForward(weights, arena, qkv_appends=QKV_APPENDS, row_threads=best[1], subgroups=best[2],
                      batch=B, seq_tile=a.seq_tile)
    (ops,) = f._segments()  # noqa: SLF001 (a probe: the same ops, recorded with a timestamp after each)
    rec = Recording(dev, ops, timestamps="ops")
    # the next token's values, as a run stages them: each sequence's position and every layer's n_used
    # at the depth (each replay appends at that same position: the arena is not advanced)
    f._stage(np.ones(B, np.int64), None)  # noqa: SLF001
    for _ in range(3):
        rec.run()
    ts = rec._timestamps()  # noqa: SLF001
    by = defaultdict(float)
    for i, label in enumerate(f.op_labels):
        by[label] += ticks_to_seconds(dev, ts[i], ts[i + 1])
    out["best_row_threads"] = best[3]
    out["profile_us"] = {k: 1e6 * v for k, v in sorted(by.items(), key=lambda kv: -kv[1])}
    for k, v in out["profile_us"].items():
        print(f"  {k:20s} {v:9.1f} µs")
    out["plan_layer0"] = repr(f.step.plans[0])
    i0 = f.op_labels.index("append + attention")  # layer 0's section: the run of its label from there
    first = list(itertools.takewhile(lambda i: f.op_labels[i] == "append + attention", range(i0, len(f.op_labels))))
    out["layer0_attention_ops_us"] = [1e6 * ticks_to_seconds(dev, ts[i], ts[i + 1]) for i in first]
    out["layer0_attention_ops"] = [names.get(id(ops[i]), ("other",))[0] for i in first]
    by_kernel = defaultdict(float)  # every op of the token, by kernel (barriers apart)
    for i, op in enumerate(ops):
        by_kernel[names.get(id(op), ("other",))[0]] += 1e6 * ticks_to_seconds(dev, ts[i], ts[i + 1])
    out["by_kernel_us"] = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1]))
    print(f"  layer 0 plan {out['plan_layer0']}")
    print("  layer 0 append + attention, op by op (µs): " + " ".join(
        f"{n}={x:.1f}" for n, x in zip(out["layer0_attention_ops"], out["layer0_attention_ops_us"])))
    for k, v in out["by_kernel_us"].items():
        print(f"  {k:32s} {v:9.1f} µs")
    rec.free()
    f.free()
    arena.free()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


def _name_ops() -> dict:
    """id(op) → the kernel variant of every dispatch op made from now on: the probe's labels
    for a recorded token's ops (kp's ops carry no name; the others — barriers, copies — are
    "other")."""
    from kvdict_vk.vk import kernels
    names = {}
    op = kernels.Kernel.op

    def named_op(self, **push):
        o = op(self, **push)
        names[id(o)] = (self.shader.variant, o)  # the op kept alive: its id is not reused
        return o
    kernels.Kernel.op = named_op
    return names


if __name__ == "__main__":
    main()
