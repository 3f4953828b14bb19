"""Probe: wall time of KvArena.step on a dict cache (8 KV heads × GQA 4, head_dim 128, K 4+4 b /
V 4+3 b, 1024 atoms per KV head, GPU encoder) with attend_flash_coded's query heads per
workgroup tuned (Attention.coded_heads None) against fixed at each allowed count.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/step_probe.py

Run as ``python lab/probes/step_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
import time

import numpy as np

from kvdict_vk import runtime, synthetic
from kvdict_vk.dictionary import KvDictArtifact, StreamDict
from kvdict_vk.vk import KvArena


def main() -> None:
    rng = np.random.default_rng(0)
    hd, nkv, na, g = 128, 8, 1024, 4
    ds = [StreamDict(rng.standard_normal((nkv, na, hd), dtype=np.float32) / np.sqrt(hd),
                     mean=rng.standard_normal((nkv, hd), dtype=np.float32) * 0.1, sparsity=4, residual_bits=b,
                     residual_scale=rng.random((nkv, hd), dtype=np.float32) + 0.5) for b in (4, 3)]
    for heads in (4, None, 1, 2, None, 4):  # interleaved, twice: a GPU idle before the first run has low clocks
        with runtime.enabled_with(KvDictArtifact(hd, na, 4, ((ds[0], ds[1]),)), allow_uncertified=True):
            a = KvArena(1, nkv, hd, 2048, cache="dict", encoder="gpu")
        a.append_codes(0, *(synthetic.random_slots(rng, d, (nkv, 1024)) for d in ds))
        att = a.attention(nkv * g)
        att.coded_heads = heads
        q = rng.standard_normal((nkv * g, hd), dtype=np.float32)
        rows = rng.standard_normal((2, nkv, 1, hd), dtype=np.float32)
        ts = []
        for i in range(300):
            t = time.perf_counter()
            a.step(0, rows[0], rows[1], q)
            ts.append(time.perf_counter() - t)
        p = att.plan(0, a.n_tokens(0))
        print(f"coded_heads {heads}: step median {1e6 * np.median(ts[50:]):.1f} µs; plan {p}", flush=True)
        a.free()


if __name__ == "__main__":
    main()
