"""The host Python of a recorded decode step's replay, without its submission.

Records KvArena.record_step over an arena of each shape and cache, replaces the recording's
``run`` with a no-op and times ``DecodeStep.run``: the checks, the K/V words (NumPy's binary16
conversion or q8_0 quantisation), the query and length writes, the token counts and the output
copy — what a replay costs the host before the GPU sees it (lab/NOTEBOOK.md, "A decode step
recorded once").

    python lab/probes/decode_step_host.py [--shapes 30x3x3x64,32x8x4x128] [--caches f16,q8_0] [--runs 200]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> None:
    from kvdict_vk.bench.common import dims
    from kvdict_vk.vk import KvArena
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="30x3x3x64,32x8x4x128", help="layers x KV heads x group x head_dim")
    ap.add_argument("--caches", default="f16,q8_0")
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for shape in (dims(s) for s in a.shapes.split(",")):
        n_layers, n_kv, group, hd = shape
        for cache in a.caches.split(","):
            arena = KvArena(n_layers, n_kv, hd, a.runs + 8, cache=cache)
            try:
                step = arena.record_step(n_kv * group, n_plan=64)
                k = rng.standard_normal((n_layers, 1, n_kv, hd), dtype=np.float32)
                q = rng.standard_normal((n_layers, 1, n_kv * group, hd), dtype=np.float32)
                step.run(k, k, q)
                step._rec.run = lambda: None  # noqa: SLF001 (the probe's point: the host part alone)
                seconds = []
                for _ in range(a.runs):
                    t = time.perf_counter()
                    step.run(k, k, q)
                    seconds.append(time.perf_counter() - t)
                print(f"{'x'.join(map(str, shape))} {cache}: {1e6 * np.median(seconds):.1f} µs of host Python a replay")
            finally:
                arena.free()


if __name__ == "__main__":
    main()
