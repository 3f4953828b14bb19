"""Probe: what $KVDICT_VK_TUNE_CACHE saves — the first plan of a layer in each context bucket
(the tuner timing every launch shape) in a process whose store is empty, then the same in a
second process reading the store. One JSON object to stdout: per (cache, n_used) the wall
seconds of the first attention in the bucket (the layer's pipelines made on its first, the
launch shape tuned or read) and of the second, and the launch shape chosen; for each coded
format also the first and second append of 1, 16 and 256 tokens with the "auto" encoder (its
choice measured or read). Run it twice with the same store:

    KVDICT_VK_TUNE_CACHE=/tmp/t.json python3 lab/probes/tune_store_probe.py > first.json
    KVDICT_VK_TUNE_CACHE=/tmp/t.json python3 lab/probes/tune_store_probe.py > second.json

The second process also finds the driver's own shader cache warm where it has one; to tell the
two apart give each run its own (NVIDIA: __GL_SHADER_DISK_CACHE_PATH=<empty dir>) —
lab/results/h200/choice_store_driver_cache.json. The appends' entries hold the auto
encoder's measurements by part (encode_choice.measurements()).

Run as ``python lab/probes/tune_store_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from kvdict_vk.bench import attention as BA, common
from kvdict_vk.vk import KvArena, choice_store
from kvdict_vk.vk.attend import tune as attend_tune


def appends(dev, bits: tuple, n_kv: int, hd: int, rng, sizes=(1, 16, 256)) -> list[dict]:
    """The encoder's side (encoder "auto": encode_choice): the wall seconds of the first append
    of each batch size to an empty arena of this format (the GPU encoder and the codec timed, or
    the stored choice taken) and of a second of the same size."""
    from kvdict_vk.vk.encode import choice as encode_choice
    arena = BA.dict_arena(bits, n_kv, hd, 2 * sum(sizes), BA.dict_args(), dev, rng, fill=False)[0]
    cases = []
    for n in sizes:
        k, v = (rng.standard_normal((n_kv, n, hd), dtype=np.float32) for _ in range(2))
        seconds = []
        for _ in range(2):
            t = time.perf_counter()
            arena.append(0, k, v)
            seconds.append(time.perf_counter() - t)
        cases.append({"append": "/".join(map(str, bits)), "tokens": n, "first_append_s": seconds[0],
                      "second_append_s": seconds[1], "encoder": sorted(set(encode_choice.measured().values())),
                      "choice_measurements": list(encode_choice.measurements().values())})
    arena.free()
    return cases


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="3x3x64", help="KV heads x GQA x head_dim")
    ap.add_argument("--n-used", default="8192,32768,131072")
    ap.add_argument("--formats", default="f16,4/3", help="f16 and/or K/V residual bits of dict-coded slots")
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    a = ap.parse_args(argv)
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    n_kv, gqa, hd = common.dims(a.shape)
    ns = [int(x) for x in a.n_used.split(",")]
    rng = np.random.default_rng(0)
    out = {"argv": sys.argv, "device": dev.name, "store": str(choice_store.path()), "cases": []}
    for fmt in a.formats.split(","):
        if fmt == "f16":
            arena = KvArena(1, n_kv, hd, max(ns), device=dev, cache="f16")
            rows = BA.random_rows(rng, n_kv, max(ns), hd)
            arena.append(0, rows, rows)
        else:
            bits = tuple(int(b) for b in fmt.split("/"))
            arena = BA.dict_arena(bits, n_kv, hd, max(ns), BA.dict_args(), dev, rng)[0]
            out["cases"] += appends(dev, bits, n_kv, hd, rng)
        att = arena.attention(n_kv * gqa)
        q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
        for n in ns:
            t = time.perf_counter()
            att.attend(0, q, n, 1.0 / np.sqrt(hd))  # the first in its bucket: plan (tuned or stored) and run
            first = time.perf_counter() - t
            t = time.perf_counter()
            att.attend(0, q, n, 1.0 / np.sqrt(hd))
            plan = att.plan(0, n)
            out["cases"].append({"cache": fmt, "n_used": n, "first_attend_s": first,
                                 "second_attend_s": time.perf_counter() - t,
                                 "local": plan.local, "n_splits": plan.n_splits, "heads": plan.heads,
                                 "kernel": plan.kernel})
        arena.free()
    out["choices_in_process"] = len(attend_tune.measured())
    out["store_entries"] = len(json.loads(store.read_text())["choices"]) if (store := choice_store.path()) and \
        store.is_file() else 0
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
