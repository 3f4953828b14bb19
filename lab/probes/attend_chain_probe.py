"""Probe: what timestamps and an idle GPU cost an attention's measured GPU time. Kompute
0.9.0 wrote a timestamp after every op (ALL_COMMANDS: each waits for the work before it);
scripts/kp_patch.py item 3 lets a recording latch only around its core ("spans"). Here one
submission chains R attentions over R layers of an f16 cache (none finds its rows in the L2:
--layers × the layer's bytes ≫ the L2), each followed by a compute→compute barrier, recorded
three ways — a timestamp after every op, timestamps at the chain's ends only, none — and,
beside it, the attention alone (the benchmark's recording: a torch L2 flush and an idle GPU
before each run) with timestamps after every op and around its core only, and with the flush
in its own submission instead (Attention.recording's flush_bytes: the GPU busy before the
passes; the flush ahead of the query's copy until 1005c2f, between the copy and the passes
since — lab/results/h200/attend_chain_flush.json was taken the first way, and with the passes' own
barrier repeated between layers where Attention.barrier_op now stands). Per attention: the
core spans, and the wall time of each chained submission less that of the submission alone
(the query's copy up and the read-back), over R. With torch + CUDA, SDPA beside it both
ways: alone as the attention benchmark times it, and as a chain of R calls over R caches
with events at its ends. One JSON object to stdout.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/attend_chain_probe.py

Run as ``python lab/probes/attend_chain_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

import numpy as np

from kvdict_vk.bench import attention as BA, common, timing, torch_anchor
from kvdict_vk.vk import KvArena
from kvdict_vk.vk.submit import Recording


# untimed rounds before the timed ones (bench.timing.measure's warm_s): the clocks up — the H200
# ran a case 2-2.5x slower after 0.2 s of warm-up (docs/DESIGN.md, "The clocks")
WARM_S = 1.0


def sdpa_chain_s(torch, n_kv: int, gqa: int, hd: int, n_used: int, layers: int, calls: int) -> float:
    """torch SDPA's counterpart of the chain: ``layers`` calls over as many f16 caches back to
    back, CUDA events around the whole (queued behind a sleep, as the anchor's calls are:
    bench.torch_anchor.timed_calls), the median over ``calls`` chains, per call."""
    F = torch.nn.functional
    q, kv = torch_anchor.decode_inputs(torch, n_kv, gqa, hd, n_used, layers=layers)

    def chain():
        for k, v in kv:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for _ in range(3):
        chain()
    torch.cuda.synchronize()
    samples, _ = torch_anchor.timed_calls(torch, chain, calls, hold_s=0.05)
    del kv
    torch.cuda.empty_cache()
    return samples[len(samples) // 2] / layers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x4x64,3x3x64", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="32768")
    ap.add_argument("--layers", type=int, default=16, help="attentions chained, one a layer")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--l2-flush-mib", type=int, default=256,
                    help="read this many MiB through torch before every run of the attention alone (0: none)")
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    a = ap.parse_args(argv)
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    before, torch = None, torch_anchor.anchor()[0]  # (None without torch + CUDA)
    if a.l2_flush_mib and torch is not None:
        before = torch_anchor.waited(torch, torch_anchor.l2_flush(torch, a.l2_flush_mib << 20))
    rng = np.random.default_rng(0)
    out = {"argv": sys.argv, "device": dev.name, "layers": a.layers, "cases": []}
    for shape in a.shapes.split(","):
        n_kv, gqa, hd = common.dims(shape)
        for n in (int(x) for x in a.n_used.split(",")):
            arena = KvArena(a.layers, n_kv, hd, n, device=dev, cache="f16")
            rows = BA.random_rows(rng, n_kv, n, hd)
            for layer in range(a.layers):
                arena.append(layer, rows, rows)
            q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
            scale = 1.0 / math.sqrt(hd)
            att = arena.attention(q.shape[0])
            att.path = "flash"
            alone_ops = att.recording(0, q, n, scale, timestamps="ops")  # warms, tunes layer 0, uploads q
            alone_spans = att.recording(0, q, n, scale, timestamps="spans")
            alone_flushed = att.recording(0, q, n, scale, timestamps="spans", flush_bytes=a.l2_flush_mib << 20)
            plan = att.plan(0, n)
            up, back = att.passes.q_upload(att.q), att.passes.read_back(att.out)
            chain = [up]
            for layer in range(a.layers):
                ops = att.passes.ops(layer, plan, n, n, scale)
                chain += ops + [att.barrier_op()]  # the next layer's passes after all of this one's writes
            chain.append(back)
            core = (1, len(chain) - 1)
            ends = Recording(dev, [up, back], what="copies alone")
            chain_ops = Recording(dev, chain, timestamps="ops", what="chain, every op timestamped", core=core)
            chain_spans = Recording(dev, chain, timestamps="spans", what="chain, its ends timestamped", core=core)
            chain_none = Recording(dev, chain, what="chain")
            recs = {"ends": ends, "ops": chain_ops, "spans": chain_spans, "none": chain_none}
            chained = timing.measure(recs, a.runs, warm_s=WARM_S)
            alone = {"ops": alone_ops, "spans": alone_spans, "spans_flush_in_submission": alone_flushed}
            alone_t = timing.measure(alone, a.runs, warm_s=WARM_S, before={"ops": before, "spans": before})
            per = 4  # ops an attention in the chain: attend, barrier, merge, barrier
            wall = {k: t["wall_s"] for k, t in chained.items()}
            case = {"shape": shape, "n_used": n, "kernel": plan.kernel, "n_splits": plan.n_splits, "local": plan.local,
                    "alone_core_s": {k: t["kernel_s"] for k, t in alone_t.items()},
                    "chain_core_per_attention_s": {k: chained[k]["kernel_s"] / a.layers for k in ("ops", "spans")},
                    "chain_op_s_first_attention": chain_ops.op_seconds()[1:1 + per],
                    "wall_copies_alone_s": wall["ends"],
                    "wall_per_attention_s": {k: (wall[k] - wall["ends"]) / a.layers for k in ("ops", "spans", "none")}}
            if torch is not None:
                case["sdpa_alone_s"] = torch_anchor.time_sdpa(
                    torch, n_kv, gqa, hd, n, calls=a.runs * 3,
                    flush=torch_anchor.l2_flush(torch, a.l2_flush_mib << 20))["seconds"]
                case["sdpa_chain_per_call_s"] = sdpa_chain_s(torch, n_kv, gqa, hd, n, a.layers, a.runs)
            out["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
            for r in (*recs.values(), *alone.values()):
                r.free()
            arena.free()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
