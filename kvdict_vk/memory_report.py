"""Memory as users meet it: the whole arena of a cache at given context lengths (issue 51).

The one source of truth for "how much memory does this cache take at N tokens": every
figure comes from :func:`kvdict_vk.layout.build_layout` — the layout ``KvArena`` allocates
and ``kvdict-dump`` prints — at that length, summed over every layer buffer: the K and V
regions, the tails (a dictionary's atoms — one copy, binary16 where the forge rounded them
—, means and residual scales; a KIVI cache's key group statistics, exact-window rings and
state word) and the alignment padding. Per length it reports

* ``arena_bytes``: the whole arena (what a user allocates for one sequence of that length);
* ``region_bytes`` / ``tail_bytes`` / ``padding_bytes``: its parts (``tail_bytes`` is every
  block that is not a K/V region: for a dictionary cache its dictionaries, fixed whatever
  the length; for KIVI the key statistics, which grow with it, and the windows);
* ``effective_bytes_per_vector``: ``arena_bytes / (n_layers · n_kv_heads · 2 · tokens)`` —
  bytes per cached head vector *at that length*, the dictionaries amortised over its
  tokens (it falls with the length toward the slot bytes; for f16 it is 128 B at head_dim
  64 at any length);
* the f16 cache's arena of the same shapes and length, and the ratio.

A cache is described as ``"f16"``, ``"f32"``, ``"q8_0"``, ``"kivi"`` (``KiviSpec()``), a
:class:`kvdict_vk.kivi.KiviSpec`, a :class:`kvdict_vk.layout.DictSpec` or a
:class:`kvdict_vk.dictionary.KvDictArtifact`. A configuration the engine does not keep (a
lever of the forge's fidelity table) is a :class:`Modelled`: an engine cache's layout plus
the bytes the lever would add — stated, never hidden in the engine rows.

Pure Python — no GPU, no I/O.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import kivi as K
from . import layout as L
from .dictionary import FORGE_N_ATOMS, FORGE_PER_HEAD, FORGE_RESIDUAL_BITS, FORGE_SPARSITY, KvDictArtifact
from .rope import KeyRope

MODEL_N_CTX = 8192  # SmolLM2-135M's context length (its GGUF's llama.context_length)
LONG_LENGTHS = (32768, 131072)  # the long contexts every report adds
REPORT_LENGTHS = (MODEL_N_CTX,) + LONG_LENGTHS
STREAMS = 2  # K and V


@dataclass(frozen=True)
class Modelled:
    """A cache configuration the engine does not keep: ``base``'s layout (an engine cache
    description, or None for none) plus ``bytes_per_vector`` more bytes per cached head
    vector and ``fixed_bytes`` more bytes once (e.g. an exact window beside the codes)."""
    base: object = None
    bytes_per_vector: float = 0.0
    fixed_bytes: int = 0
    note: str = ""


@dataclass(frozen=True)
class ArenaFootprint:
    """One cache at one context length (bytes; ``vs_f16`` = arena / the f16 arena)."""
    n_ctx: int
    arena_bytes: int
    region_bytes: int
    tail_bytes: int
    padding_bytes: int
    bytes_per_token: float
    effective_bytes_per_vector: float
    f16_arena_bytes: int
    vs_f16: float

    def to_dict(self) -> dict:
        return asdict(self)


def dictionary_spec(n_layers: int, n_kv_heads: int, head_dim: int, n_atoms: int = FORGE_N_ATOMS,
                    k=(FORGE_SPARSITY, FORGE_RESIDUAL_BITS[0]), v=(FORGE_SPARSITY, FORGE_RESIDUAL_BITS[1]), *,
                    per_head: bool = FORGE_PER_HEAD, has_mean: bool = True, atoms_f16: bool = True,
                    keys_before_rope: bool = False) -> L.DictSpec:
    """A dictionary cache's shapes without an artifact: every layer's K coded at ``k`` =
    (sparsity, residual bits) and V at ``v``; defaults: the forge's (one dictionary of 1024
    atoms with a mean a stream, shared by the layer's KV heads — ``per_head``: one per KV
    head —, K 4 atoms + 6 bits, V 4 atoms + 4 bits, binary16 atoms). ``keys_before_rope``:
    each layer's rotation table too (kvdict_vk.rope; its size depends on head_dim and n_ctx
    only, so the turn's theta here is any)."""
    g = n_kv_heads if per_head else 1
    ks, vs = (L.StreamSpec(True, s, has_mean, b, g) for s, b in (k, v))
    return L.DictSpec(head_dim, n_atoms, max(k[0], v[0]), tuple((ks, vs) for _ in range(n_layers)), g, atoms_f16,
                      key_rope=KeyRope(10000.0, head_dim) if keys_before_rope else None)


def cache_name(cache) -> str:
    """A short human name of a cache description."""
    if isinstance(cache, str):
        return cache
    if isinstance(cache, K.KiviSpec):
        bits = f"{cache.k_bits} bit" if cache.k_bits == cache.v_bits else f"K{cache.k_bits} V{cache.v_bits}"
        return f"kivi {bits} + {cache.recent} recent"
    if isinstance(cache, KvDictArtifact):
        cache = L.DictSpec.from_artifact(cache)
    if isinstance(cache, L.DictSpec):
        coded = [s for pair in cache.layers for s in pair if s.coded]
        kv = [next((p[j] for p in cache.layers if p[j].coded), None) for j in (0, 1)]
        parts = [f"{n} {s.sparsity}+{s.residual_bits} b" for n, s in zip("KV", kv) if s is not None]
        heads = "per-head" if cache.n_heads > 1 else "shared"
        turned = ", keys before RoPE" if cache.key_rope is not None else ""
        return f"dict {cache.n_atoms} atoms {heads}, " + ", ".join(parts) + turned if coded else "dict (all passthrough)"
    if isinstance(cache, Modelled):
        return f"{'—' if cache.base is None else cache_name(cache.base)} (modelled: {cache.note})"
    raise TypeError(f"not a cache description: {type(cache).__name__}")


def build(n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, cache) -> L.ArenaLayout:
    """The engine layout of an engine cache description at ``n_ctx`` tokens."""
    if isinstance(cache, K.KiviSpec):
        return L.build_layout(n_layers, n_kv_heads, head_dim, n_ctx, cache=L.KIVI_CACHE, kivi=cache)
    if isinstance(cache, (L.DictSpec, KvDictArtifact)):
        return L.build_layout(n_layers, n_kv_heads, head_dim, n_ctx, cache)
    if isinstance(cache, str):
        return L.build_layout(n_layers, n_kv_heads, head_dim, n_ctx, cache=cache)
    raise TypeError(f"not an engine cache description: {type(cache).__name__}")


def split(lay: L.ArenaLayout) -> tuple[int, int, int]:
    """(region, tail, padding) bytes of a layout, as kvdict-dump's totals count them: the K
    and V regions; every other block (atoms, means, residual scales, KIVI
    group statistics, windows, the KIVI state word); the rest (alignment, guards)."""
    region = tail = 0
    for ll in lay.layers:
        for s in ll.streams:
            region += s.region_words
            tail += s.atoms_words + s.mean_words + s.scale_words
            if s.kivi:
                tail += s.stats_words + s.window_words
        if ll.k.kivi:
            tail += 1  # the layer's state word
    w = L.WORD_BYTES
    return region * w, tail * w, lay.total_bytes - (region + tail) * w


def arena_memory(n_layers: int, n_kv_heads: int, head_dim: int, cache, lengths) -> list[ArenaFootprint]:
    """The whole arena of ``cache`` for these shapes at each of ``lengths`` tokens."""
    out = []
    vectors = n_layers * n_kv_heads * STREAMS
    for n in lengths:
        n = int(n)
        f16 = build(n_layers, n_kv_heads, head_dim, n, "f16").total_bytes
        extra_vec, extra_fixed, base = 0.0, 0, cache
        if isinstance(cache, Modelled):
            extra_vec, extra_fixed, base = float(cache.bytes_per_vector), int(cache.fixed_bytes), cache.base
        if base is None:
            total = region = tail = pad = 0
            per_token = 0.0
        else:
            lay = build(n_layers, n_kv_heads, head_dim, n, base)
            total, per_token = lay.total_bytes, float(lay.bytes_per_token)
            region, tail, pad = split(lay)
        added = round(extra_vec * vectors * n)
        total, region, tail = total + added + extra_fixed, region + added, tail + extra_fixed
        per_token += extra_vec * vectors
        per_token = int(per_token) if float(per_token).is_integer() else per_token
        out.append(ArenaFootprint(n, total, region, tail, pad, per_token, total / (vectors * n), f16, total / f16))
    return out


def report_lengths(n_ctx: int | None = None, model_n_ctx: int | None = None) -> list[int]:
    """The lengths a report shows: ``n_ctx`` (if given), the model's context (default
    SmolLM2's 8 192), 32 768 and 131 072 — each once, in order."""
    out = []
    for n in (n_ctx, model_n_ctx or MODEL_N_CTX) + LONG_LENGTHS:
        if n and int(n) not in out:
            out.append(int(n))
    return out


def memory_block(n_layers: int, n_kv_heads: int, head_dim: int, cache, lengths) -> dict:
    """The JSON form (kvdict-dump --json's "memory", the demo's report)."""
    return dict(cache=cache_name(cache), source="kvdict_vk.memory_report.arena_memory (kvdict_vk.layout.build_layout)",
                shapes=dict(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim),
                vectors_per_token=n_layers * n_kv_heads * STREAMS,
                lengths=[m.to_dict() for m in arena_memory(n_layers, n_kv_heads, head_dim, cache, lengths)])


def format_memory(block: dict, indent: str = "") -> list[str]:
    """The human table of a memory block: one line per length."""
    mib = 2 ** 20
    lines = [f"{indent}{'tokens':>8} {'arena MiB':>10} {'of which tails':>15} {'B/vector (effective)':>21} "
             f"{'f16 MiB':>9} {'vs f16':>7}"]
    for m in block["lengths"]:
        lines.append(f"{indent}{m['n_ctx']:>8} {m['arena_bytes'] / mib:>10.2f} {m['tail_bytes'] / mib:>15.2f} "
                     f"{m['effective_bytes_per_vector']:>21.2f} {m['f16_arena_bytes'] / mib:>9.2f} "
                     f"{m['vs_f16']:>6.2f}×")
    return lines
