"""What the attention benchmark and its batched rows (bench.attention_batch) share — the dict
arenas, random rows, and our recordings' L2 flush — so that neither imports the other's module
for them (bench.attention imports bench.attention_batch, one direction only). Probes time
what the benchmark times through these too.
"""
from __future__ import annotations

import numpy as np

from . import timing


def format_name(bits) -> str:
    return f"k{bits[0]}v{bits[1]}"


def dict_arena(bits, n_kv, hd, n_ctx, args, dev, rng, seqs: int = 1, fill: bool = True, window=None,
               key_rope=None):
    """A one-layer dict arena filled with n_ctx tokens of random valid slots (the cost depends
    little on what the codes say — how often nearby code words share an atom is the exception,
    so ``args.code_words`` can put captured ones in; OMP-encoding that many rows would dominate
    the run) — with ``seqs`` sequences, the same slots in each; returns (arena, its (K, V)
    StreamDicts, the (K, V) slots). ``args``: per_head, n_atoms, sparsity, code_words (None:
    uniformly random code words). The atoms are binary16 values, as
    the forge's are (ForgeConfig.f16_atoms), so reconstruct-then-attend takes the path a forged
    artifact takes (the arena's atoms in binary16). ``fill`` False: the arena
    left empty (for appends). ``window``: a kvdict_vk.window.ExactWindow the artifact keeps
    (its rows random, one sequence); ``key_rope``: a kvdict_vk.rope.KeyRope its keys are coded
    before (one sequence)."""
    from kvdict_vk import runtime, synthetic
    from kvdict_vk.dictionary import KvDictArtifact
    from kvdict_vk.vk import KvArena
    na = args.n_atoms
    dicts = synthetic.random_dicts(rng, hd, na, args.sparsity, bits, n_kv if args.per_head else 1)
    art = KvDictArtifact(hd, na, args.sparsity, ((dicts[0], dicts[1]),), *([window] if window else []),
                         key_rope=key_rope)
    with runtime.enabled_with(art, allow_uncertified=True):
        arena = KvArena(1, n_kv, hd, n_ctx, device=dev, cache="dict", seqs=seqs)
    slots = [synthetic.random_slots(rng, d, (n_kv, n_ctx)) for d in dicts]
    if args.code_words is not None:  # captured (K, V) code words
        slots = [synthetic.with_code_words(s, c) for s, c in zip(slots, args.code_words)]
    rows = [random_rows(rng, n_kv, n_ctx, hd) for _ in "kv"] if window and fill else None
    for seq in range(seqs if fill else 0):
        arena.append_codes(0, *slots, seq=seq, rows=rows)
    return arena, dicts, slots


def random_rows(rng, n_kv, n_ctx, hd, block: int = 4096):
    """(n_kv, n_ctx, hd) float32: a random block of tokens repeated (drawing 10⁸ normals
    takes seconds; the cost of an attention does not depend on the values)."""
    b = rng.standard_normal((n_kv, min(n_ctx, block), hd), dtype=np.float32)
    return np.ascontiguousarray(np.tile(b, (1, -(-n_ctx // b.shape[1]), 1))[:, :n_ctx])


FLUSH_WAYS = ("torch", "submission", "primed")


def our_flush_bytes(args, anchor) -> int:
    """The L2 flush our recordings carry in their own submission (--our-flush submission or
    primed, where the run flushes at all: torch + CUDA, --l2-flush-mib > 0), or 0."""
    submission = args.our_flush in ("submission", "primed")
    return args.l2_flush_mib << 20 if submission and anchor.l2_flush is not None else 0


def our_recording_args(args, anchor) -> dict:
    """Attention.recording's / batch_recording's flush_bytes and primed for this run."""
    flush = our_flush_bytes(args, anchor)
    return {"flush_bytes": flush, "primed": bool(flush) and args.our_flush == "primed"}


def flush_before(candidates: dict, args, anchor):
    """timing.measure's ``before``: torch's flush before every candidate, or (--our-flush
    submission / primed) before those that do not flush in their own submission only (the
    callables)."""
    if not our_flush_bytes(args, anchor):
        return anchor.l2_flush
    return {n: anchor.l2_flush for n, c in candidates.items() if not timing.is_recording(c)}
