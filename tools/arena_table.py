"""The arena of each cache type at SmolLM2-135M's full context, from the project's layout code.

    python tools/arena_table.py [--out docs/results/arena.json]

For SmolLM2-135M's shapes (30 layers, 3 KV heads, head_dim 64) at its full context (8 192
tokens) this builds, with ``kvdict_vk.layout.build_layout`` — the module ``KvArena``
allocates from and ``kvdict-dump`` prints — the layout of every cache the engine keeps:
f16, f32 and q8_0 rows, the KIVI cache (``KiviSpec()``: 4 bits, the 128 newest tokens in
binary16) and the certified dictionary default (a dictionary of 1024 atoms with a mean a
stream, shared by the layer's KV heads, K 4 atoms + a 6-bit residual stage, V 4 atoms + 4
bits, binary16 atoms: the forge's defaults, docs/results/fidelity.json's "default"), and
the same with one dictionary per KV head ("dict per-head"). The dictionary's shapes come
from a synthetic ``DictSpec``: no artifact and no GPU are needed. Writes one row per cache:
the arena's bytes (regions, tail, padding), its bytes per token, per head vector (K and V
averaged: ``bytes_per_token / (n_layers · n_kv_heads · 2)``), and the regions alone per
head vector (what grows with the context; the dictionaries' tail does not).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python tools/arena_table.py --out docs/results/arena.json"

MODEL = dict(name="SmolLM2-135M", n_layers=30, n_kv_heads=3, head_dim=64, n_ctx=8192)
LENGTHS = (8192, 32768, 131072)  # the model's context, 32 k and 128 k tokens (issue 51)
sys.path.insert(0, str(ROOT))
from kvdict_vk.dictionary import (FORGE_N_ATOMS, FORGE_PER_HEAD, FORGE_RESIDUAL_BITS,  # noqa: E402
                                  FORGE_SPARSITY)

DICT_DEFAULT = dict(n_atoms=FORGE_N_ATOMS, per_kv_head=FORGE_PER_HEAD, has_mean=True, atoms_f16=True,
                    k=dict(sparsity=FORGE_SPARSITY, residual_bits=FORGE_RESIDUAL_BITS[0]),
                    v=dict(sparsity=FORGE_SPARSITY, residual_bits=FORGE_RESIDUAL_BITS[1]))


def dictionary_spec(n_layers: int, n_kv_heads: int, head_dim: int, per_kv_head: bool | None = None):
    from kvdict_vk.memory_report import dictionary_spec as spec
    d = DICT_DEFAULT
    per_head = d["per_kv_head"] if per_kv_head is None else per_kv_head
    return spec(n_layers, n_kv_heads, head_dim, d["n_atoms"], (d["k"]["sparsity"], d["k"]["residual_bits"]),
                (d["v"]["sparsity"], d["v"]["residual_bits"]), per_head=per_head, has_mean=d["has_mean"],
                atoms_f16=d["atoms_f16"])


def rows() -> list[dict]:
    """One row per cache at the model's context (the keys kept from before) and, under
    ``lengths``, the whole arena at 8 192, 32 768 and 131 072 tokens — every number from
    ``kvdict_vk.memory_report.arena_memory`` (``build_layout``'s layer buffers)."""
    from kvdict_vk.memory_report import arena_memory, build
    m = MODEL
    shapes = (m["n_layers"], m["n_kv_heads"], m["head_dim"])
    vectors_per_token = m["n_layers"] * m["n_kv_heads"] * 2
    cases = [("f16", "f16"), ("f32", "f32"), ("q8_0", "q8_0"), ("kivi", "kivi"), ("dict", dictionary_spec(*shapes)),
             ("dict per-head", dictionary_spec(*shapes, per_kv_head=True))]
    out = []
    for name, cache in cases:
        at = arena_memory(*shapes, cache, LENGTHS)
        t = at[LENGTHS.index(m["n_ctx"])]
        mode = build(*shapes, m["n_ctx"], cache).mode
        out.append(dict(cache=name, mode=mode, arena_bytes=t.arena_bytes, arena_mib=t.arena_bytes / 2 ** 20,
                        region_bytes=t.region_bytes, tail_bytes=t.tail_bytes,
                        padding_bytes=t.padding_bytes, bytes_per_token=t.bytes_per_token,
                        bytes_per_head_vector=t.bytes_per_token / vectors_per_token,
                        region_bytes_per_head_vector=t.region_bytes / (m["n_ctx"] * vectors_per_token),
                        compression_vs_f16=m["n_layers"] * m["n_kv_heads"] * 2 * m["head_dim"] * 2 / t.bytes_per_token,
                        effective_bytes_per_head_vector=t.effective_bytes_per_vector,
                        lengths={str(a.n_ctx): dict(arena_bytes=a.arena_bytes, arena_mib=a.arena_bytes / 2 ** 20,
                                                    tail_bytes=a.tail_bytes,
                                                    effective_bytes_per_vector=a.effective_bytes_per_vector,
                                                    f16_arena_bytes=a.f16_arena_bytes, vs_f16=a.vs_f16)
                                 for a in at}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "arena.json"))
    a = ap.parse_args(argv)
    doc = dict(command=COMMAND, model=MODEL, dictionary_default=DICT_DEFAULT,
               kivi_default=dict(k_bits=4, v_bits=4, recent=128),
               lengths=list(LENGTHS),
               notes=["every number from kvdict_vk.memory_report.arena_memory, which sums the layer buffers "
                      "kvdict_vk.layout.build_layout computes (kvdict-dump's totals)",
                      "lengths.N: the whole arena (regions + tails + padding) at N tokens; "
                      "effective_bytes_per_vector = arena_bytes / (n_layers * n_kv_heads * 2 * N): the "
                      "dictionaries amortised over the tokens",
                      "bytes_per_head_vector = bytes_per_token / (n_layers * n_kv_heads * 2); the dictionary's "
                      "tail (atoms, means, scales) is fixed and counted in arena_bytes, not "
                      "in bytes_per_token"],
               rows=rows())
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in doc["rows"]:
        print(f"{r['cache']:<13} {r['bytes_per_head_vector']:7.2f} B/vector  {r['arena_mib']:8.2f} MiB "
              f"(regions {r['region_bytes'] / 2 ** 20:.2f}, tail {r['tail_bytes'] / 2 ** 20:.2f}); effective "
              + ", ".join(f"{v['effective_bytes_per_vector']:.2f} B at {n}" for n, v in r["lengths"].items()),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
