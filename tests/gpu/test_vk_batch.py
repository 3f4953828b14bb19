"""Batched decode: B sequences of one arena, each with its own length, attended in the same
flash dispatches (KvArena(seqs=B), append/read with seq=, attend_batch), against the
float64 reference per sequence — over the f16, f32 and q8_0 caches and the dict-coded one
with both kernels over the codes. Every arena here is guarded (conftest.make_arena verifies
the sentinels after each test), so a sequence's rows or a record written out of place show.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_artifact
from kvdict_vk import errors as E
from kvdict_vk import layout as L
from kvdict_vk import rows as R
from kvdict_vk.metrics import nmse
from kvdict_vk.synthetic import random_slots
from test_vk_attend import reference

pytestmark = pytest.mark.gpu

LENGTHS = (300, 1, 129, 77)  # a sequence of one token, one of a single split, unequal others


def _fill(arena, rng, art, lengths):
    """Each sequence b gets lengths[b] random rows / slots (two appends); returns per
    sequence (K, V, K dict, V dict) as the cache holds them."""
    lay, stored = arena.layout, []
    pair = (None, None) if art is None else art.layers[0]
    for b, n in enumerate(lengths):
        kv = []
        for d in pair:
            if d is None:
                kv.append(rng.standard_normal((lay.n_kv_heads, n, lay.head_dim), dtype=np.float32))
            else:
                kv.append(random_slots(rng, d, (lay.n_kv_heads, n), out_of_range=0.05))
        cut = n // 2
        arena.append_codes(0, kv[0][:, :cut], kv[1][:, :cut], seq=b)
        assert arena.append_codes(0, kv[0][:, cut:], kv[1][:, cut:], seq=b) == n
        held = [R.held_rows(x, arena.mode) if d is None else x for x, d in zip(kv, pair)]
        stored.append((*held, *pair))
    return stored


def _check_batch(arena, stored, q, n_used, limit=1e-9):
    out = arena.attend_batch(0, q, n_used)
    assert out.dtype == np.float32 and out.shape == q.shape
    for b, (k, v, kd, vd) in enumerate(stored[:len(n_used)]):
        err = nmse(reference(q[b], k, v, kd, vd, n_used[b]), out[b])
        assert err <= limit, f"sequence {b}, n_used {n_used[b]}: NMSE {err:.3g}"
    return out


@pytest.mark.parametrize("kernel", ["float", "wide_end"])
@pytest.mark.parametrize("cache", ["f16", "f32", "q8_0"])
def test_batched_attention_over_rows_equals_reference(cache, kernel, make_arena):
    """attend_flash over B sequences of rows, in both builds (attend.FLASH_KERNELS: the split's
    end 2 elements a pass, or in a few barriers)."""
    rng = np.random.default_rng(21)
    n_kv, g, hd = 2, 3, 64
    arena = make_arena(1, n_kv, hd, max(LENGTHS), cache=cache, seqs=len(LENGTHS))
    assert arena.seqs == len(LENGTHS) and arena.seq_ctx == max(LENGTHS)
    stored = _fill(arena, rng, None, LENGTHS)
    att = arena.attention(n_kv * g)
    att.path, att.flash_kernel = "flash", kernel  # CPU drivers plan other paths for one sequence
    assert att.plan(0, max(LENGTHS), seqs=len(LENGTHS)).kernel == kernel
    q = rng.standard_normal((len(LENGTHS), n_kv * g, hd), dtype=np.float32)
    _check_batch(arena, stored, q, list(LENGTHS))
    _check_batch(arena, stored, q, [5, 1, 129, 2])  # fewer tokens than appended
    _check_batch(arena, stored, q[:2], [300, 1])  # the first sequences only


@pytest.mark.parametrize("per_head", [True, False])
def test_batched_attention_over_codes_equals_reference(per_head, make_arena, activate):
    rng = np.random.default_rng(22 + per_head)
    n_kv, g, hd = 2, 4, 64
    art = random_artifact(rng, hd, 256, [((4, 4), (4, 3))], n_heads=n_kv if per_head else 1)
    activate(art)
    arena = make_arena(1, n_kv, hd, max(LENGTHS), seqs=len(LENGTHS))
    assert arena.mode == "dict"
    stored = _fill(arena, rng, art, LENGTHS)
    att = arena.attention(n_kv * g)
    att.path = "flash"
    q = rng.standard_normal((len(LENGTHS), n_kv * g, hd), dtype=np.float32)
    _check_batch(arena, stored, q, list(LENGTHS))
    _check_batch(arena, stored, q * 40, [300, 1, 100, 77])  # large scores: the references move
    # the batch's plan: every sequence in one flash dispatch of the chosen kernel
    p = att.plan(0, 300, seqs=len(LENGTHS))
    assert p.path == "flash" and p.seqs == len(LENGTHS) and p.kernel == "float"
    # recorded for the benchmark, the passes primed (run twice a submission) and the L2 flushed:
    # every run as exact as attend_batch, every sequence
    with att.batch_recording(0, q, list(LENGTHS), 1 / 8, flush_bytes=1 << 20, primed=True) as rec:
        for _ in range(2):
            rec.run()
            got = att.output(len(LENGTHS))
            for b, (k, v, kd, vd) in enumerate(stored):
                assert nmse(reference(q[b], k, v, kd, vd, LENGTHS[b], 1 / 8), got[b]) <= 1e-9
    _check_batch(arena, stored, q, list(LENGTHS))  # nothing left behind (not bitwise: on a GPU the
    # order of the atom weights' float sums varies from run to run)


def test_many_short_sequences(make_arena, activate):
    """64 sequences (the issue's largest batch) of a few tokens each, over the codes."""
    rng = np.random.default_rng(23)
    n_kv, g, hd, B = 2, 2, 32, 64
    art = random_artifact(rng, hd, 64, [((2, 2), (3, 0))], n_heads=n_kv)
    activate(art)
    arena = make_arena(1, n_kv, hd, 24, seqs=B)
    lengths = [1 + (7 * b) % 24 for b in range(B)]
    stored = _fill(arena, rng, art, lengths)
    arena.attention(n_kv * g).path = "flash"
    q = rng.standard_normal((B, n_kv * g, hd), dtype=np.float32)
    _check_batch(arena, stored, q, lengths)


def test_sequences_are_isolated(make_arena):
    """Appending to one sequence changes no other: reads per sequence return its own rows,
    token counts move per sequence, and a full sequence refuses more while the others accept."""
    rng = np.random.default_rng(24)
    arena = make_arena(1, 2, 32, 16, cache="f32", seqs=3)
    rows = [rng.standard_normal((2, n, 32), dtype=np.float32) for n in (16, 5, 0)]
    for b, r in enumerate(rows):
        arena.append(0, r, r + 1, seq=b)
    for b, r in enumerate(rows):
        assert arena.n_tokens(0, seq=b) == r.shape[1]
        k, v = arena.read(0, seq=b)
        assert np.array_equal(k, r) and np.array_equal(v, r + 1)
    with pytest.raises(E.ArenaError, match="exceed n_ctx 16"):
        arena.append(0, rows[0][:, :1], rows[0][:, :1], seq=0)
    assert arena.n_tokens(0, seq=0) == 16 and arena.n_tokens(0, seq=2) == 0
    arena.append(0, rows[0][:, :3], rows[0][:, :3], seq=2)
    assert np.array_equal(arena.read(0, seq=1)[0], rows[1])
    assert np.array_equal(arena.read(0, 1, 3, seq=2)[0], rows[0][:, 1:3])


def test_batched_attention_equals_one_sequence_arenas(make_arena):
    """A sequence of a batch attends exactly as the same rows in an arena of their own
    (the GPU against the GPU: the same kernels and plans, only the batch differs)."""
    rng = np.random.default_rng(25)
    n_kv, g, hd, lengths = 2, 2, 64, (200, 90)
    batch = make_arena(1, n_kv, hd, 200, cache="f16", seqs=2)
    batch.attention(n_kv * g).path = "flash"
    q = rng.standard_normal((2, n_kv * g, hd), dtype=np.float32)
    singles = []
    for b, n in enumerate(lengths):
        k, v = (rng.standard_normal((n_kv, n, hd), dtype=np.float32) for _ in range(2))
        batch.append(0, k, v, seq=b)
        one = make_arena(1, n_kv, hd, 200, cache="f16")
        one.attention(n_kv * g).path = "flash"
        one.append(0, k, v)
        singles.append(one.attend(0, q[b], n))
    out = batch.attend_batch(0, q, list(lengths))
    for b in range(2):
        assert nmse(singles[b].astype(np.float64), out[b]) <= 1e-12


def test_bad_batched_calls_are_refused_and_change_nothing(make_arena):
    rng = np.random.default_rng(26)
    arena = make_arena(1, 2, 32, 8, cache="f32", seqs=2)
    r = rng.standard_normal((2, 4, 32), dtype=np.float32)
    arena.append(0, r, r, seq=0)
    arena.append(0, r[:, :2], r[:, :2], seq=1)
    q = rng.standard_normal((2, 4, 32), dtype=np.float32)
    with pytest.raises(E.ArenaError, match="attend_batch"):
        arena.attend(0, q[0], 4)  # one sequence's call on a batched arena
    with pytest.raises(E.ArenaError, match="attend_batch"):
        arena.step(0, r[:, :1], r[:, :1], q[0])
    with pytest.raises(E.ArenaError, match="n_used"):
        arena.attend_batch(0, q, [4, 3])  # more than sequence 1 holds
    with pytest.raises(E.ArenaError, match="n_used"):
        arena.attend_batch(0, q, [4, 0])
    with pytest.raises(E.ArenaError, match="2 integers"):
        arena.attend_batch(0, q, [4])
    with pytest.raises(E.ShapeError, match="B, n_heads, head_dim"):
        arena.attend_batch(0, np.concatenate([q, q[:1]]), [4, 2, 2])  # three sequences of two
    with pytest.raises(E.ShapeError):
        arena.attend_batch(0, q.astype(np.float64), [4, 2])
    for seq in (2, -1, 1.0, True):
        with pytest.raises(E.ArenaError, match="seq must be"):
            arena.append(0, r, r, seq=seq)
    with pytest.raises(E.ArenaError, match="seqs must be"):
        make_arena(1, 2, 32, 8, cache="f32", seqs=0)
    assert [arena.n_tokens(0, seq=b) for b in (0, 1)] == [4, 2]
    att = arena.attention(4)
    att.path = "flash"
    out = arena.attend_batch(0, q, [4, 2])
    assert np.isfinite(out).all()


@pytest.mark.parametrize("cache", ["f16", "dict", "dict-gpu-encoder"])
def test_step_batch_equals_appends_then_attend_batch(cache, make_arena, activate):
    """step_batch (every sequence's new tokens in one scatter — or, GPU-encoded, a sequence at
    a time — then attend_batch) equals the same tokens appended sequence by sequence and
    attend_batch, on a twin arena."""
    rng = np.random.default_rng(27)
    n_kv, g, hd, B = 2, 2, 32, 3
    if cache.startswith("dict"):
        activate(random_artifact(rng, hd, 64, [((2, 3), (2, 2))], n_heads=n_kv))
    kw = {"cache": cache} if cache == "f16" else {"encoder": "gpu"} if cache == "dict-gpu-encoder" else {}
    stepped, twin = (make_arena(1, n_kv, hd, 40, seqs=B, **kw) for _ in range(2))
    for a in (stepped, twin):
        a.attention(n_kv * g).path = "flash"
    for t, n_new in enumerate((5, 1, 1)):  # a prompt of 5 tokens, then two decode steps
        k, v = (rng.standard_normal((B, n_kv, n_new, hd), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((B, n_kv * g, hd), dtype=np.float32)
        got = stepped.step_batch(0, k, v, q)
        for b in range(B):
            twin.append(0, k[b], v[b], seq=b)
        want = twin.attend_batch(0, q, [twin.n_tokens(0, seq=b) for b in range(B)])
        assert [stepped.n_tokens(0, seq=b) for b in range(B)] == [5 + t] * B
        assert got.shape == (B, n_kv * g, hd) and nmse(want.astype(np.float64), got) <= 1e-12


def test_batched_kivi_cache_equals_each_sequences_reference(make_arena):
    """A batched KIVI arena: each sequence's statistics, rings and state word its own (KIVI
    heads, layout.StreamLayout.kivi_head; 300 tokens a sequence, not whole groups). Reads of
    every sequence are kivi.cache_rows of its rows bit for bit; attend_batch (attend_flash_kivi
    over every sequence) is the float64 reference per sequence; step_batch's host appends and a
    recorded step of the batch (append_kivi: a workgroup a sequence's KV head) keep both —
    and a twin arena's words — through groups leaving the windows, a host append after the
    device's included."""
    from kvdict_vk import kivi as K
    rng = np.random.default_rng(29)
    n_kv, g, hd, spec, B = 2, 3, 64, K.KiviSpec(4, 2, 8), len(LENGTHS)
    stepped, twin = (make_arena(2, n_kv, hd, max(LENGTHS), cache="kivi", kivi=spec, seqs=B) for _ in range(2))
    held = [[None] * B for _ in range(2)]

    def append(layer, b, k, v):
        for a in (stepped, twin):
            a.append(layer, k, v, seq=b)
        held[layer][b] = (k, v) if held[layer][b] is None else tuple(
            np.concatenate([h, x], axis=1) for h, x in zip(held[layer][b], (k, v)))

    def check(layer, n_used=None):
        for b in range(B):
            n = stepped.n_tokens(layer, seq=b)
            want = K.cache_rows(*held[layer][b], n, spec)
            for a in (stepped, twin):
                assert all(np.array_equal(x, y) for x, y in zip(a.read(layer, seq=b), want)), (layer, b)
        q = rng.standard_normal((B, n_kv * g, hd), dtype=np.float32)
        used = n_used or [stepped.n_tokens(layer, seq=b) for b in range(B)]
        out = stepped.attend_batch(layer, q, used)
        for b in range(B):
            want = K.attend(q[b], *held[layer][b], stepped.n_tokens(layer, seq=b), used[b], spec)
            assert nmse(want, out[b]) <= 1e-9, (layer, b, used[b])

    first = [max(n - 45, 1) for n in LENGTHS]  # room for 45 more tokens each
    for layer in range(2):
        for b, n in enumerate(first):
            for part in (n // 2, n - n // 2):
                if part:
                    append(layer, b, *(rng.standard_normal((n_kv, part, hd), dtype=np.float32) for _ in range(2)))
        check(layer)
    check(0, [5, 1, 40, 17])
    for _ in range(3):  # step_batch: every sequence's token planned on the host, one attention
        k, v = (rng.standard_normal((B, n_kv, 1, hd), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((B, n_kv * g, hd), dtype=np.float32)
        got = stepped.step_batch(1, k, v, q)
        for b in range(B):
            twin.append(1, k[b], v[b], seq=b)
            held[1][b] = tuple(np.concatenate([h, x], axis=1) for h, x in zip(held[1][b], (k[b], v[b])))
            want = K.attend(q[b], *held[1][b], stepped.n_tokens(1, seq=b), stepped.n_tokens(1, seq=b), spec)
            assert nmse(want, got[b]) <= 1e-9
    for b in range(B):  # layer 0 as long as layer 1 again
        append(0, b, *(rng.standard_normal((n_kv, 3, hd), dtype=np.float32) for _ in range(2)))
    step = stepped.record_step(n_kv * g, batch=B)
    for t in range(36):  # every sequence's group leaves its window at least once
        if t == 20:
            for layer in range(2):
                for b in range(B):
                    append(layer, b, *(rng.standard_normal((n_kv, 3, hd), dtype=np.float32) for _ in range(2)))
        k, v = (rng.standard_normal((2, B, n_kv, hd), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((2, B, n_kv * g, hd), dtype=np.float32)
        got = step.run(k, v, q)
        for layer in range(2):
            want = twin.step_batch(layer, k[layer][:, :, None], v[layer][:, :, None], q[layer])
            assert nmse(want, got[layer]) <= 1e-9, (t, layer)
            for b in range(B):
                held[layer][b] = tuple(np.concatenate([h, x[:, None]], axis=1)
                                       for h, x in zip(held[layer][b], (k[layer, b], v[layer, b])))
    assert [stepped.n_tokens(0, seq=b) for b in range(B)] == [n + 42 for n in first]
    for layer in range(2):
        check(layer)
    step.free()


def test_step_batch_refuses_before_writing(make_arena):
    """A sequence without room, or a bad query, refuses the whole step: no sequence gains a token."""
    rng = np.random.default_rng(28)
    arena = make_arena(1, 2, 32, 4, cache="f32", seqs=2)
    arena.append(0, *(rng.standard_normal((2, 4, 32), dtype=np.float32) for _ in range(2)), seq=1)  # full
    k = rng.standard_normal((2, 2, 1, 32), dtype=np.float32)
    q = rng.standard_normal((2, 4, 32), dtype=np.float32)
    with pytest.raises(E.ArenaError, match="exceed n_ctx 4"):
        arena.step_batch(0, k, k, q)
    with pytest.raises(E.ShapeError):
        arena.step_batch(0, k[:, :, :0][:1], k[:, :, :0][:1], q[:1].astype(np.float64))
    with pytest.raises(E.ShapeError, match="same sequences"):
        arena.step_batch(0, k, k, q[:1])
    with pytest.raises(E.ArenaError, match="n_used 0"):  # no tokens at all in sequence 0
        arena.step_batch(0, k[:1, :, :0], k[:1, :, :0], q[:1])
    assert [arena.n_tokens(0, seq=b) for b in (0, 1)] == [0, 4]
