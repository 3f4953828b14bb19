"""Which certified cache wins (issue 51): every row the forge measured that passes the gate,
ranked by its whole arena at the model's context length — the memory a user allocates — with
the winner and why it won.

A row's cache configuration is read from its name (the fidelity table names rows by their
settings: ``q8_0``, ``KIVI 4 bit + 128 recent``, ``KIVI K5 V4``, ``dict 1024 shared atoms, K 4+6 b,
V 4+4 b + sink 1 + 32 recent``, …: :func:`cache_of`), its arena from
:func:`kvdict_vk.memory_report.arena_memory` (the layout ``KvArena`` allocates), whether it
passes from :func:`kvdict_vk.forge.pipeline.gate_passes` over every text's upper bound.
"""
from __future__ import annotations

import dataclasses
import re

from .. import kivi as K
from .. import memory_report as M
from ..window import NO_WINDOW, ExactWindow
from .pipeline import gate_passes

# the rows the forge's default run measures beside its dictionary (kvdict-forge, the demo):
# the engine's other compressed caches at their defaults
RANKED_BASELINES = ("q8_0", "KIVI 4 bit + 128 recent")


def cache_of(name: str, bytes_per_vector: float, shapes) -> tuple:
    """(cache description for memory_report, memory_model) of a fidelity row: "engine" when the
    engine keeps that cache (its arena is exactly KvArena's), else how it was modelled (a lever
    the engine does not run: an engine layout plus the bytes the lever adds, stated)."""
    n_layers, n_kv, hd = shapes
    if name in ("f16", "f32", "q8_0"):
        return name, "engine"
    m = re.fullmatch(r"KIVI (?:(\d) bit|K(\d) V(\d))(?: \+ (\d+) recent)?", name)
    if m:
        kb, vb = (int(m[1]), int(m[1])) if m[1] else (int(m[2]), int(m[3]))
        return K.KiviSpec(kb, vb, int(m[4] or 0)), "engine"
    m = re.fullmatch(r"dict (\d+) (shared )?atoms, K (\d+)\+(\d+) b, V (\d+)\+(\d+) b(, keys before RoPE)?( \+ .*)?",
                     name)
    if m:
        spec = M.dictionary_spec(n_layers, n_kv, hd, int(m[1]), (int(m[3]), int(m[4])), (int(m[5]), int(m[6])),
                                 per_head=not m[2], keys_before_rope=bool(m[7]))
        lever = (m[8] or "")[3:]
        share = re.match(r"(\d+) layers a dictionary(?: \+ |$)", lever)  # forge's layer_share
        lever = lever[share.end():] if share else lever
        w = re.fullmatch(r"(?:sink (\d*) ?\+ )?(\d+) recent|sink (\d+)", lever)  # the engine's exact window
        if w:  # "sink + 32 recent" is the lever's name for sink 1
            sink = int(w[3]) if w[3] else (int(w[1]) if w[1] else (1 if "sink" in lever else 0))
            lever, spec = "", dataclasses.replace(spec, window=ExactWindow(sink, int(w[2] or 0)))
        if share and not lever:  # the engine keeps a layer's atoms in its tail: modelled as stored once a run
            plain = dataclasses.replace(spec, window=NO_WINDOW)
            every = M.arena_memory(n_layers, n_kv, hd, plain, (1,))[0].tail_bytes  # the dictionaries' tails
            runs = -(-n_layers // int(share[1]))  # the last run may be shorter
            saved = every // n_layers * (n_layers - runs)  # every layer's tail alike
            return M.Modelled(spec, 0.0, -saved, f"dictionaries shared by {share[1]} layers"), \
                f"modelled: the dictionary arena with its tails stored once per {share[1]} layers ({saved} B less)"
        if not lever:
            return spec, "engine"
        slot_bpv = M.build(n_layers, n_kv, hd, 64, spec).bytes_per_token / (n_layers * n_kv * 2)
        if lever == "group scales":
            return M.Modelled(spec, bytes_per_vector - slot_bpv, 0, "per-32-token residual scales"), \
                f"modelled: the dictionary arena + {bytes_per_vector - slot_bpv:g} B per vector of group scales"
        raise ValueError(f"no cache configuration known for the dictionary lever {lever!r} in row {name!r}")
    m = re.fullmatch(r"residual only \(s 0\) K(\d) V(\d) b( \+ group scales)?", name)
    if m:  # per (layer, stream, KV head): a float32 mean, and a static scale unless group scales
        fixed = n_layers * 2 * n_kv * hd * 4 * (1 if m[3] else 2)
        return M.Modelled(None, bytes_per_vector, fixed, "residual-only rows"), \
            "modelled: the row's bytes per vector + float32 means" + ("" if m[3] else " and scales")
    if re.fullmatch(r"Hadamard \+ q\d_\d", name):
        return M.Modelled(None, bytes_per_vector, 0, "rotated block rows"), \
            "modelled: the row's bytes per vector (a fixed Hadamard transform, nothing stored)"
    raise ValueError(f"no cache configuration known for row {name!r}")


def rank(rows: list[dict], shapes, n_ctx: int, threshold: float, caches: dict | None = None) -> dict:
    """The ranking of the forge's rows ({name, kind, bytes_per_vector, texts: {text: {ci95, …}}})
    that the engine keeps: {"n_ctx", "threshold", "rows": [...] passing ones first by their whole
    arena at n_ctx, then the rest by it, "winner": the first passing row's name (None: none
    passes), "winner_kind", "reason"}. ``caches``: a row's cache description by name where its
    name does not say it all (the certified artifact itself)."""
    out = []
    for r in rows:
        cache, how = (caches[r["name"]], "engine") if r["name"] in (caches or {}) else \
            cache_of(r["name"], r["bytes_per_vector"], shapes)
        if how != "engine":
            continue
        at = M.arena_memory(*shapes, cache, (n_ctx,))[0]
        uppers = [t["ci95"][1] for t in r["texts"].values()]
        worst = max(r["texts"].items(), key=lambda kv: kv[1]["ci95"][1])
        out.append(dict(name=r["name"], kind=r["kind"], passes=gate_passes(uppers, threshold),
                        arena_bytes=at.arena_bytes, effective_bytes_per_vector=at.effective_bytes_per_vector,
                        worst_text=worst[0], worst_delta_ppl=worst[1]["delta_rel"], worst_upper=worst[1]["ci95"][1],
                        memory_model=how))
    out.sort(key=lambda r: (not r["passes"], r["arena_bytes"], r["name"]))
    winner = out[0] if out and out[0]["passes"] else None
    if winner is None:
        reason = f"no cache passes the gate (the upper 95 % bound of ΔPPL ≤ +{100 * threshold:g} % on every text)"
    else:
        rest = [r for r in out[1:] if r["passes"]]
        mib = 2 ** 20
        reason = (f"the smallest whole arena at {n_ctx} tokens ({winner['arena_bytes'] / mib:.1f} MiB) among the "
                  f"caches that pass the gate")
        if rest:
            reason += f"; next: {rest[0]['name']} at {rest[0]['arena_bytes'] / mib:.1f} MiB"
        if winner["kind"] != "dictionary":
            reason += "; not a dictionary — the dictionary cache stays a certified option"
    return dict(n_ctx=n_ctx, threshold=threshold, rows=out, winner=None if winner is None else winner["name"],
                winner_kind=None if winner is None else winner["kind"], reason=reason)


def engine_cache(name: str, shapes):
    """How KvArena keeps a ranked row's cache: ("kivi", KiviSpec), ("q8_0" | "f16" | "f32", None)
    or ("dict", None) (the certified artifact); ValueError for a lever the engine does not run."""
    cache, how = cache_of(name, 0.0, shapes)
    if how != "engine":
        raise ValueError(f"the engine does not keep {name!r} ({how})")
    if isinstance(cache, K.KiviSpec):
        return "kivi", cache
    if isinstance(cache, str):
        return cache, None
    return "dict", None
