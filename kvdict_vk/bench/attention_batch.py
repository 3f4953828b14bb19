"""Batched decode attention (kvdict_vk.bench.attention ``--batches``): B sequences of
``--batch-n-used`` tokens each, attended in one call (KvArena(seqs=B).attend_batch: every
sequence in the same flash dispatches), over the f16, q8_0 and KIVI caches (KIVI's default
settings: each sequence's groups, rings and state its own) and each dict format —
beside torch SDPA over an f16 cache of the same B in the same process (the issue's
"batched" rows: ``batch`` = B, ``n_used`` per sequence).

Every sequence holds the same rows / slots (the cost of an attention does not depend on
the values, and filling 64 sequences with fresh random rows would dominate the run); the
dict arenas are bench.attention_common.dict_arena's. The f32
cache is left out: at 64 × 8192 tokens of 8 × 128 f32 a layer buffer passes the 4 GiB a
storage buffer binds.
"""
from __future__ import annotations

import numpy as np

from . import roofline, timing, traffic
from .attention_common import dict_arena, flush_before, format_name, our_recording_args, random_rows

CACHES = ("f16", "q8_0", "kivi")


def _arenas(n_kv, hd, batch, n_used, args, dev, rng) -> dict:
    """{mode: (arena, cache, format)}: the uncoded caches and one dict arena per format,
    each with ``batch`` sequences of the same n_used tokens."""
    from kvdict_vk.vk import KvArena
    made = {}
    try:
        rows = [random_rows(rng, n_kv, n_used, hd) for _ in "kv"]
        for cache in CACHES:
            arena = made[f"{cache}_cache"] = (KvArena(1, n_kv, hd, n_used, device=dev, cache=cache, seqs=batch),
                                              cache, None)
            for b in range(batch):
                arena[0].append(0, *rows, seq=b)
        del rows
        for bits in args.format_list:
            made[f"dict_{format_name(bits)}"] = (dict_arena(bits, n_kv, hd, n_used, args, dev, rng, seqs=batch)[0],
                                                 "dict", format_name(bits))
    except BaseException:
        for a, _, _ in made.values():
            a.free()
        raise
    return made


def bench_batch(batch: int, shape, args, dev, rng, anchor, roof) -> dict:
    """One (shape, B) case: every mode's batched attention timed (interleaved repeats), and
    torch SDPA at the same B."""
    n_kv, gqa, hd = shape
    n_used = args.batch_n_used
    arenas = _arenas(n_kv, hd, batch, n_used, args, dev, rng)
    recs = {}
    try:
        q = rng.standard_normal((batch, n_kv * gqa, hd), dtype=np.float32)
        scale = 1.0 / np.sqrt(hd)
        info = {}
        for mode, (arena, cache, fmt) in arenas.items():
            att = arena.attention(n_kv * gqa)
            recs[mode] = att.batch_recording(0, q, [n_used] * batch, scale, timestamps=True,
                                             **our_recording_args(args, anchor))
            recs[mode].run()  # warm-up
            p = att.plan(0, n_used, seqs=batch)
            info[mode] = {"cache": cache, "format": fmt, "forced": None, "bytes":
                          traffic.bytes_moved("attend", arena.layout, 0, n_used, plan=p, n_heads=n_kv * gqa),
                          "plan": {"path": p.path, "n_splits": p.n_splits, "split_len": p.split_len, "local": p.local,
                                   "heads": p.heads, "seqs": p.seqs, "kernel": p.kernel, "variant": att.variant(0, p)}}
        times = timing.measure(recs, args.repeats, budget_s=args.case_budget_s,
                               warm_s=timing.warm_for(dev), before=flush_before(recs, args, anchor))
    finally:
        for rec in recs.values():
            rec.free()
        for a, _, _ in arenas.values():
            a.free()
    out = {"n_used": n_used, "batch": batch, "torch_sdpa_f16_s": anchor.seconds(n_kv, gqa, hd, n_used, batch),
           "modes": {}}
    for mode, t in times.items():
        out["modes"][mode] = {**info[mode], "seconds": t,
                              "roofline_fraction": roofline.fraction(info[mode]["bytes"]["total"], t, roof)}
    return out
