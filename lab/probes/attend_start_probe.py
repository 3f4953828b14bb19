"""Probe: what an attention pays for being its pipelines' first dispatch in a submission. The
chain probe (lab/probes/attend_chain_probe.py) found an attention alone in its submission 7-8 µs
slower than one in a chain of 16, even with an L2 flush in the same submission ahead of it,
and the first attention of a chain as slow as one alone. Here one attention over layer 0 of
an f16 cache (the L2 flushed by l2_flush in the same submission every time), recorded with
different work ahead of it, timestamps around its passes only:

* ``flush_up``: the flush, the query's copy up, the passes (Attention.recording's order with
  flush_bytes until 1005c2f, which put the flush after the copy);
* ``up_flush``: the copy up, the flush, the passes (a compute dispatch between the copy and them);
* ``up_other_flush``: the copy up, an attention over layer 1 and a barrier, the flush, the passes
  (the pipeline already run in this submission);
* ``up_other``: the copy up, an attention over layer 1, a barrier, the passes (a chain of two,
  the second timed; its rows not in the L2 either: layer 1's pushed them out);
* ``up_twin_flush``: as ``up_other_flush``, the attention ahead from another engine
  (attend.Attention of its own: other scratch buffers, other pipelines, the same SPIR-V).

The attention ahead is followed by Attention.barrier_op (every buffer its engine owns; the
committed lab/results/h200/attend_first_dispatch*.json were taken with the passes' own barrier between
attend and merge repeated after the merge, on fewer buffers).

With torch + CUDA, SDPA alone as the attention benchmark times it, beside. One JSON object
to stdout.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/attend_start_probe.py

Run as ``python lab/probes/attend_start_probe.py`` from the checkout with the package installed
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
from kvdict_vk.vk.attend import engine as A
from kvdict_vk.vk.submit import Recording

WARM_S = 1.0  # as attend_chain_probe: the clocks up before the timed rounds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x4x64,3x3x64", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="32768")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--l2-flush-mib", type=int, default=256)
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    a = ap.parse_args(argv)
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    torch = torch_anchor.anchor()[0]
    rng = np.random.default_rng(0)
    out = {"argv": sys.argv, "device": dev.name, "cases": []}
    flush_bytes = a.l2_flush_mib << 20
    for shape in a.shapes.split(","):
        n_kv, gqa, hd = common.dims(shape)
        for n in (int(x) for x in a.n_used.split(",")):
            arena = KvArena(2, n_kv, hd, n, device=dev, cache="f16")
            rows = BA.random_rows(rng, n_kv, n, hd)
            for layer in range(2):
                arena.append(layer, rows, rows)
            q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
            scale = 1.0 / math.sqrt(hd)
            att = arena.attention(q.shape[0])
            att.path = "flash"
            recs = {"up_flush": att.recording(0, q, n, scale, timestamps="spans", flush_bytes=flush_bytes)}
            plan = att.plan(0, n)
            up, back = att.passes.q_upload(att.q), att.passes.read_back(att.out)
            flush = att.flush_ops(flush_bytes)
            mine = att.passes.ops(0, plan, n, n, scale)
            other = att.passes.ops(1, plan, n, n, scale) + [att.barrier_op()]
            first = len(flush) + 1
            recs["flush_up"] = Recording(dev, [*flush, up, *mine, back], timestamps="spans", what="flush_up",
                                         core=(first, first + len(mine)))

            def rec(name, ahead):
                first = 1 + len(ahead)
                recs[name] = Recording(dev, [up, *ahead, *mine, back], timestamps="spans", what=name,
                                       core=(first, first + len(mine)))
            rec("up_other_flush", [*other, *flush])
            rec("up_other", other)
            # the same ahead of it from another engine: its own scratch buffers, the same SPIR-V
            twin = A.Attention(arena.memory, q.shape[0])
            twin.path = "flash"
            twin_ops = twin.passes.ops(1, twin.plan(1, n), n, n, scale)
            rec("up_twin_flush", [twin.passes.q_upload(twin.q), *twin_ops, twin.barrier_op(), *flush])
            t = timing.measure(recs, a.runs, warm_s=WARM_S)
            case = {"shape": shape, "n_used": n, "kernel": plan.kernel, "n_splits": plan.n_splits,
                    "core_s": {k: v["kernel_s"] for k, v in t.items()}}
            if torch is not None:
                flush = torch_anchor.l2_flush(torch, flush_bytes)
                case["sdpa_alone_s"] = torch_anchor.time_sdpa(torch, n_kv, gqa, hd, n, calls=a.runs * 3,
                                                              flush=flush)["seconds"]
            out["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
            for r in recs.values():
                r.free()
            twin.free()
            arena.free()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
