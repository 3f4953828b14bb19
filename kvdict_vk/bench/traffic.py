"""Bytes an operation moves, counted from the arena layout: the one definition every
benchmark row's ``bytes`` (and so its ``roofline_fraction``) comes from.

Each byte is counted once per pass that reads it and once per pass that writes it — the
compulsory traffic of the operation, not what its loads add up to (a direct-path unit
re-reads its KV head's tokens, a split pass re-reads the bins it accumulates into; those
come from the caches). So ``bytes / time`` is the operation's effective bandwidth, and its
ratio to the copy roofline says how close it runs to the memory's limit.

    cache       the stored K/V words of the tokens touched (slots, f16, f32 or q8_0 rows,
                a KIVI layer's levels, group statistics and exact window)
    dictionary  atoms (at most the block; fewer when few tokens gather few rows), means and
                residual scales of the coded streams the passes read; keys coded before RoPE
                their rotation table
    scratch     what the passes write and a later pass (or the same one) reads back: the
                q·atom table, scores, per-split atom weights, records, atom-weight products,
                reconstructed rows
    output      what the operation hands over (attention output, reconstructed rows,
                the copy's destination)

The query (a few KiB) is left out.
"""
from __future__ import annotations

from .. import kivi as K
from ..layout import WORD_BYTES
from ..vk.attend.specs import n_blocks

OPS = ("attend", "read", "reconstruct_then_attend", "copy")
ROW_PATHS = ("direct", "flash")  # attention paths that read each token's K/V (decoding slots if coded)
TABLE_PATHS = ("table",)


def bytes_moved(op: str, layout=None, layer: int = 0, n_tokens: int = 0, *, plan=None, n_heads: int = 0,
                n_words: int = 0) -> dict:
    """{"cache", "dictionary", "scratch", "output", "total"} bytes of one operation:

    * "attend" — one decode attention over tokens [0, n_tokens) of ``layer`` with
      ``n_heads`` query heads, run as ``plan`` (kvdict_vk.vk.attend.plan.Plan);
    * "read" — KvArena.read of n_tokens tokens (reconstruct or row copy into f32 rows);
    * "reconstruct_then_attend" — "read", then the direct path over those f32 rows as ``plan``;
    * "copy" — the copy shader over ``n_words`` words (read once, written once).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "copy":
        parts = {"cache": n_words, "dictionary": 0, "scratch": 0, "output": n_words}
    else:
        ll = layout.layers[layer]
        if op == "attend":
            parts = _attend(layout, ll, plan, n_tokens, n_heads)
        else:
            parts = _read(layout, ll, n_tokens)
            if op == "reconstruct_then_attend":
                rows = parts.pop("output")  # written by the read, read by the attention
                att = _attend_rows(layout, plan, n_tokens, n_heads)
                parts = {"cache": parts["cache"], "dictionary": parts["dictionary"],
                         "scratch": parts["scratch"] + 2 * rows + att["scratch"], "output": att["output"]}
    out = {k: v * WORD_BYTES for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def _cache_words(layout, ll, n_tokens: int) -> int:
    """The stored words of n_tokens: their rows / slots; a KIVI layer's key group statistics
    (a word per channel and 32-token group) and its exact window rows too."""
    words = layout.n_kv_heads * n_tokens * (ll.k.row_words + ll.v.row_words)
    if ll.k.kivi:
        n_kv, hd = layout.n_kv_heads, layout.head_dim
        window_rows = min(n_tokens, ll.k.window_tokens)  # the exact tokens read, K and V
        words += n_kv * (K.stats_words_per_head(n_tokens, hd) + 2 * K.window_words_per_head(window_rows, hd))
    return words


def _atoms_touched(layout, st, gathers: int) -> int:
    """Atom words a coded stream's passes read: each dictionary head's atoms, at most the
    whole block, at most the rows ``gathers`` code words (per dictionary head) can name."""
    if not st.coded:
        return 0
    rows = min(layout.n_atoms, gathers) if gathers is not None else layout.n_atoms
    return st.n_dict_heads * rows * layout.head_dim


def _side_words(st) -> int:
    """Mean and residual-scale words of a coded stream (all dictionary heads)."""
    if not st.coded:
        return 0
    return (st.mean_words if st.has_mean else 0) + (st.scale_words if st.residual_bits else 0)


def _rope_words(layout, st) -> int:
    """The rotation table of a K stream coded before RoPE (kvdict_vk.rope; 0 otherwise)."""
    return 0 if st.key_rope is None else (st.rope_hi_rows + (1 << st.rope_shift)) * layout.head_dim


def _gathers(layout, st, n_tokens: int) -> int:
    """Code words per dictionary head over n_tokens tokens of every KV head."""
    heads_per_dict = layout.n_kv_heads // st.n_dict_heads
    return heads_per_dict * n_tokens * st.sparsity


def _read(layout, ll, n_tokens: int) -> dict:
    # binary16 atoms (where the layout keeps them so): half the words
    dictionary = sum(_atoms_touched(layout, st, _gathers(layout, st, n_tokens)) // (1 + st.atoms_f16)
                     + _side_words(st) for st in ll.streams)
    return {"cache": _cache_words(layout, ll, n_tokens), "dictionary": dictionary, "scratch": 0,
            "output": 2 * layout.n_kv_heads * n_tokens * layout.head_dim}


def _records_words(plan, n_kv: int, n_heads: int, head_dim: int) -> int:
    """Split records (accumulator + max + sum per query head) written, then read by the
    merge/combine: none when one direct split writes the output itself."""
    if plan.write_out:
        return 0
    return 2 * n_kv * plan.records * (n_heads // n_kv) * (head_dim + 2)


def _attend(layout, ll, plan, n_used: int, n_heads: int) -> dict:
    hd, n_kv, n_atoms = layout.head_dim, layout.n_kv_heads, layout.n_atoms
    k, v = ll.k, ll.v
    if plan.path not in ROW_PATHS + TABLE_PATHS:
        raise ValueError(f"no byte count for the {plan.path!r} attention path (kvdict_vk.bench.traffic)")
    scratch = _records_words(plan, n_kv, n_heads, hd)
    if plan.path == "flash" and k.coded:  # attend_flash_coded: the table pass, the atom weights × atoms
        dictionary = sum(_atoms_touched(layout, st, None) + _side_words(st) for st in ll.streams)
        if k.key_rope is None:
            scratch += 2 * n_heads * n_atoms  # the q·atom table: written, read into shared memory
        else:  # its K_ROPE build: no table, each key decoded and turned
            dictionary += _rope_words(layout, k)
    elif plan.path in ROW_PATHS:
        dictionary = sum(_atoms_touched(layout, st, _gathers(layout, st, n_used)) + _side_words(st)
                         for st in ll.streams) + _rope_words(layout, k)
    else:  # table: the table pass and the atoms pass stream whole atom blocks
        dictionary = sum(_atoms_touched(layout, st, None) + _side_words(st) for st in ll.streams)
        scratch += 2 * n_heads * n_used  # scores: written, read by the split's second walk
        if k.coded:
            scratch += 2 * n_heads * n_atoms  # the q·atom table: written, read by the split pass
        if v.coded:
            bins = n_kv * plan.records * (n_heads // n_kv) * n_atoms
            blocks = n_heads * n_blocks(n_atoms) * hd  # attend_atoms' products, read by the reduce
            scratch += 4 * bins + 2 * blocks  # bins: split read+write, atoms pass read+clear
    # a batched plan: plan.seqs sequences of n_used tokens each, sharing the dictionary reads
    seqs = plan.seqs
    return {"cache": seqs * _cache_words(layout, ll, n_used), "dictionary": dictionary, "scratch": seqs * scratch,
            "output": seqs * n_heads * hd}


def _attend_rows(layout, plan, n_tokens: int, n_heads: int) -> dict:
    return {"scratch": _records_words(plan, layout.n_kv_heads, n_heads, layout.head_dim),
            "output": n_heads * layout.head_dim}
