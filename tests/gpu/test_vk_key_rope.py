"""Keys coded before RoPE on the device (kvdict_vk.rope; shaders/rope_rows.comp, the K_ROPE builds
of attend_direct and attend_flash_coded): reads of such a layer equal the slots' decode turned to
each token's position in float64 (the forge's reconstruction) to NMSE ≤ 1e-9, appends code the
keys turned back to position 0 (on the host before the CPU codec or the GPU encoder), attention
(attend by either pass, step, the read-out path, beside an exact window) matches the float64
reference, guard words stay intact (make_arena checks them), and what cannot turn such keys —
the table pass, the flash pass over a passthrough V, a recorded step, several sequences — is
refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import random_artifact, stable_seed
from kvdict_vk import attention_ref, codec
from kvdict_vk import errors as E
from kvdict_vk.metrics import nmse
from kvdict_vk.rope import KeyRope
from kvdict_vk.synthetic import random_slots
from kvdict_vk.vk.attend.specs import flash_coded_key_lanes
from kvdict_vk.window import NO_WINDOW, ExactWindow, cache_rows

CASES = [  # (head_dim, n_kv, n_ctx, rope, streams, dictionary heads, append sizes)
    (64, 3, 300, KeyRope(10000.0, 64), ((4, 6), (4, 4)), 1, (1, 1, 40, 1, 100, 3)),
    (32, 2, 1100, KeyRope(500000.0, 16), ((3, 0), None), 2, (2, 1, 600, 1, 300)),  # partial rotation, per head
    (16, 1, 70, KeyRope(100.0, 16), (2, (2, 3)), 1, (70,)),
]


def _art(rng, hd, rope, streams, heads, window=NO_WINDOW):
    art = random_artifact(rng, hd, 64, [streams, (None, None)], n_heads=heads)
    return dataclasses.replace(art, key_rope=rope, window=window)


def _coded_keys(art, k, sizes):
    """What the cache's keys are after appends of ``sizes`` tokens, float64: each append's keys
    turned back to position 0, coded as one batch by the CPU codec, decoded, turned back."""
    d, rope, parts, t = art.layers[0][0], art.key_rope, [], 0
    for n in sizes:
        slots = codec.encode_heads(rope.unturn(k[:, t:t + n], t), d)
        parts.append(rope.rotate(codec.decode_heads(slots, d), t))
        t += n
    return np.concatenate(parts, axis=1)


def _values(art, v, sizes):
    d = art.layers[0][1]
    if d is None:
        return v[:, :sum(sizes)].astype(np.float64)
    out, t = [], 0
    for n in sizes:
        out.append(codec.decode_heads(codec.encode_heads(v[:, t:t + n], d), d))
        t += n
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[0]}-kv{c[1]}-dims{c[3].dims}")
def test_reads_and_attention_equal_the_turned_reference(case, make_arena, activate):
    hd, n_kv, n_ctx, rope, streams, heads, sizes = case
    rng = np.random.default_rng(hd + n_ctx)
    art = _art(rng, hd, rope, streams, heads)
    activate(art)
    arena = make_arena(2, n_kv, hd, n_ctx)
    k_st = arena.layout.layers[0].k
    assert k_st.key_rope == rope and arena.layout.layers[1].k.key_rope is None
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    q = rng.standard_normal((2 * n_kv, hd)).astype(np.float32)
    n = 0
    for i, size in enumerate(sizes):
        arena.append(0, k[:, n:n + size], v[:, n:n + size])
        n += size
        want_k, want_v = _coded_keys(art, k, sizes[:i + 1]), _values(art, v, sizes[:i + 1])
        got_k, got_v = arena.read(0, 0, n)
        assert nmse(want_k, got_k) <= 1e-9 and nmse(want_v, got_v) <= 1e-9
        t0 = n // 3  # a middle range turns from its own first position
        assert nmse(want_k[:, t0:], arena.read(0, t0, n)[0]) <= 1e-9
        ref = attention_ref.attend(q, want_k, want_v, n)
        for used in sorted({1, n}):
            got = arena.attend(0, q, used)
            assert nmse(attention_ref.attend(q, want_k, want_v, used), got) <= 1e-9
        assert nmse(ref, arena.attention(q.shape[0]).attend_reconstructed(0, q, n, 1 / np.sqrt(hd))) <= 1e-9


def test_decoding_the_forge_slots_turns_them(make_arena, activate):
    """Slots as the forge codes the keys before RoPE, appended as they are: every read and
    attention turns their decode to the token's position (the forge's reconstruction)."""
    hd, n_kv, n = 64, 2, 257
    rng = np.random.default_rng(5)
    art = _art(rng, hd, KeyRope(10000.0, 64), ((4, 6), (4, 4)), 1)
    activate(art)
    arena = make_arena(2, n_kv, hd, n)
    pre = rng.standard_normal((n_kv, n, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n, hd)).astype(np.float32)
    dk, dv = art.layers[0]
    k_slots, v_slots = codec.encode_heads(pre, dk), codec.encode_heads(v, dv)
    arena.append_codes(0, k_slots[:, :100], v_slots[:, :100])
    arena.append_codes(0, k_slots[:, 100:], v_slots[:, 100:])
    want_k = art.key_rope.rotate(codec.decode_heads(k_slots, dk), 0)
    want_v = codec.decode_heads(v_slots, dv)
    got_k, got_v = arena.read(0)
    assert nmse(want_k, got_k) <= 1e-9 and nmse(want_v, got_v) <= 1e-9
    q = rng.standard_normal((3 * n_kv, hd)).astype(np.float32)
    assert nmse(attention_ref.attend(q, want_k, want_v, n), arena.attend(0, q, n)) <= 1e-9


# (head_dim, n_kv, GQA, n_atoms, per-head dictionaries, (K, V) streams, n_ctx, binary16 atoms, rope)
FLASH_CASES = [
    (64, 2, 4, 256, True, ((4, 6), (4, 4)), 3000, False, KeyRope(10000.0, 64)),  # many chunks, every head block
    (64, 3, 3, 512, False, ((4, 4), (4, 3)), 700, True, KeyRope(10000.0, 64)),
    (128, 1, 2, 128, False, (2, (2, 3)), 400, False, KeyRope(500000.0, 32)),  # partial rotation, K atoms only
    (32, 2, 1, 64, True, ((3, 2), 3), 300, True, KeyRope(100.0, 32)),
    (16, 1, 2, 64, False, ((2, 5), (2, 2)), 70, False, KeyRope(100.0, 16)),
    (64, 2, 2, 1024, True, ((4, 6), (4, 4)), 1500, True, KeyRope(10000.0, 64)),  # a key over several invocations
    (64, 1, 3, 2048, False, ((4, 5), (4, 3)), 900, False, KeyRope(10000.0, 64)),
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: "hd{}-kv{}-g{}-a{}-f16{}-dims{}".format(
    *c[:4], int(c[7]), c[8].dims))
def test_the_flash_pass_turns_each_key(case, make_arena, activate):
    """attend_flash_coded's K_ROPE build: each key decoded (out-of-range code words add zero),
    turned to its position and scored, at every number of query heads a workgroup, one split or
    several, each key decoded by one invocation or several (KEY_LANES), equals the float64
    attention over the turned decode, and attend_direct's."""
    hd, n_kv, g, n_atoms, per_head, pair, n_ctx, f16, rope = case
    rng = np.random.default_rng(stable_seed(case))
    art = random_artifact(rng, hd, n_atoms, [pair], n_heads=n_kv if per_head else 1, f16_atoms=f16)
    art = dataclasses.replace(art, key_rope=rope)
    activate(art)
    arena = make_arena(1, n_kv, hd, n_ctx)
    assert all(st.atoms_f16 == f16 for st in arena.layout.layers[0].streams)
    kd, vd = art.layers[0]
    k, v = (random_slots(rng, d, (n_kv, n_ctx), out_of_range=0.05) for d in (kd, vd))
    arena.append_codes(0, k[:, :n_ctx // 3], v[:, :n_ctx // 3])
    arena.append_codes(0, k[:, n_ctx // 3:], v[:, n_ctx // 3:])
    want_k = rope.rotate(codec.decode_heads(k, kd, np.float64), 0)
    want_v = codec.decode_heads(v, vd, np.float64)
    att = arena.attention(n_kv * g)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    options = [hb for hb, _ in att.shapes.flash_coded_options(0)]
    assert options and g % options[-1] == 0
    for hb in options:
        att.path, att.coded_heads = "flash", hb
        for n_used in sorted({1, min(129, n_ctx), n_ctx // 2 + 1, n_ctx}):
            p = att.plan(0, n_used)
            assert p.path == "flash" and p.heads == hb and att.variant(0, p) == "attend_flash_coded"
            lanes = flash_coded_key_lanes(hd, f16, n_atoms, p.local)
            assert lanes >= 2 if n_atoms >= 1024 else lanes >= 1
            ref = attention_ref.attend(q, want_k, want_v, n_used)
            assert nmse(ref, arena.attend(0, q, n_used)) <= 1e-9, (hb, n_used)
    att.coded_workgroups = n_kv * (g // options[-1]) * 6  # up to six splits a head block, whole rounds each
    assert att.plan(0, n_ctx).n_splits > 1 or n_ctx < 1000
    flash = arena.attend(0, q * 40, n_ctx)  # large scores: the reference moves
    assert nmse(attention_ref.attend(q * 40, want_k, want_v, n_ctx), flash) <= 1e-9
    att.path = "direct"
    assert nmse(arena.attend(0, q * 40, n_ctx), flash) <= 1e-9


def test_steps_attend_over_their_fresh_turned_keys(make_arena, activate):
    """KvArena.step and a recorded step (the flash pass) code the new token's key turned back
    from its position and attend over it (the fresh slots turned as the cached ones are; the
    device forward's step: tests/gpu/test_vk_forward.py)."""
    hd, n_kv, n_ctx, pre, steps = 64, 2, 200, 37, 5
    rng = np.random.default_rng(11)
    art = _art(rng, hd, KeyRope(10000.0, 64), ((4, 6), (4, 4)), 1)
    activate(art)
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    qs = rng.standard_normal((steps, 2 * n_kv, hd)).astype(np.float32)
    sizes = (pre,) + (1,) * steps
    want_k, want_v = _coded_keys(art, k, sizes), _values(art, v, sizes)
    a, r = make_arena(2, n_kv, hd, n_ctx), make_arena(2, n_kv, hd, n_ctx)
    for x in (a, r):
        x.append(0, k[:, :pre], v[:, :pre])
    step = r.record_step(2 * n_kv, layers=[0])
    assert step.plans[0].path == "flash"
    for s in range(steps):
        t = pre + s
        ref = attention_ref.attend(qs[s], want_k, want_v, t + 1)
        assert nmse(ref, a.step(0, k[:, t:t + 1], v[:, t:t + 1], qs[s])) <= 1e-9
        got = step.run(k[None, :, t:t + 1].transpose(0, 2, 1, 3).copy(), v[None, :, t:t + 1].transpose(0, 2, 1, 3).copy(),
                       qs[s][None, None])
        assert nmse(ref, got[0, 0]) <= 1e-9
    for x in (a, r):
        assert nmse(want_k, x.read(0)[0]) <= 1e-9 and x.n_tokens(0) == pre + steps
    step.free()


def test_turned_keys_beside_an_exact_window(make_arena, activate):
    hd, n_kv, n_ctx, window = 64, 2, 300, ExactWindow(1, 16)
    rng = np.random.default_rng(3)
    art = _art(rng, hd, KeyRope(10000.0, 64), ((4, 6), (4, 4)), 1, window)
    activate(art)
    arena = make_arena(2, n_kv, hd, n_ctx)
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    q = rng.standard_normal((2 * n_kv, hd)).astype(np.float32)
    sizes = (1, 50, 1, 120)
    n = 0
    att = arena.attention(2 * n_kv)
    for i, size in enumerate(sizes):
        arena.append(0, k[:, n:n + size], v[:, n:n + size])
        n += size
        want_k = cache_rows(_coded_keys(art, k, sizes[:i + 1]), k, window)
        want_v = cache_rows(_values(art, v, sizes[:i + 1]), v, window)
        got_k, got_v = arena.read(0)
        assert nmse(want_k, got_k) <= 1e-9 and nmse(want_v, got_v) <= 1e-9
        for att.path in ("direct", "flash"):  # either pass beside attend_window
            assert nmse(attention_ref.attend(q, want_k, want_v, n), arena.attend(0, q, n)) <= 1e-9


def test_what_cannot_turn_keys_is_refused(make_arena, activate):
    hd, n_kv = 64, 2
    rng = np.random.default_rng(1)
    art = _art(rng, hd, KeyRope(10000.0, 64), ((4, 6), (4, 4)), 1)
    activate(art)
    arena = make_arena(2, n_kv, hd, 64)
    k = rng.standard_normal((n_kv, 10, hd)).astype(np.float32)
    arena.append(0, k, k)
    q = rng.standard_normal((n_kv, hd)).astype(np.float32)
    before = arena.read(0)
    arena.attention(n_kv).path = "table"
    with pytest.raises(E.ArenaError, match="before RoPE"):
        arena.attend(0, q, 10)
    arena.attention(n_kv).path = None
    for a, b in zip(before, arena.read(0)):
        np.testing.assert_array_equal(a, b)
    # the flash pass turns coded keys beside coded values only
    activate(_art(rng, hd, KeyRope(10000.0, 64), ((4, 6), None), 1))
    plain_v = make_arena(2, n_kv, hd, 64)
    plain_v.append(0, k, k)
    att = plain_v.attention(n_kv)
    assert not att.shapes.flash_fits(0) and att.plan(0, 10).path == "direct"
    att.path = "flash"
    with pytest.raises(E.ArenaError, match="before RoPE"):
        plain_v.attend(0, q, 10)


def test_a_batch_turns_each_sequence_from_its_own_positions(make_arena, activate):
    """A batched arena (KvArena(seqs=3)): appends, reads, attend_batch, step_batch and a recorded
    step of the batch code each sequence's keys turned back from its own positions and turn them
    to those positions again — every sequence against the float64 reference of its own tokens."""
    hd, n_kv, g, lengths = 64, 2, 2, (50, 20, 33)
    rng = np.random.default_rng(9)
    art = _art(rng, hd, KeyRope(10000.0, 64), ((4, 6), (4, 4)), n_kv)
    activate(art)
    arena = make_arena(2, n_kv, hd, 64, seqs=len(lengths))
    k = [rng.standard_normal((n_kv, 64, hd)).astype(np.float32) for _ in lengths]
    v = [rng.standard_normal((n_kv, 64, hd)).astype(np.float32) for _ in lengths]
    for b, n in enumerate(lengths):
        arena.append(0, k[b][:, :n], v[b][:, :n], seq=b)
    sizes = [[n] for n in lengths]

    def check(qs):
        want = [(_coded_keys(art, k[b], sizes[b]), _values(art, v[b], sizes[b])) for b in range(len(lengths))]
        for b, (wk, wv) in enumerate(want):
            assert nmse(wk, arena.read(0, seq=b)[0]) <= 1e-9 and nmse(wv, arena.read(0, seq=b)[1]) <= 1e-9
            assert nmse(wk[:, 7:], arena.read(0, 7, seq=b)[0]) <= 1e-9  # a range turns from its own first position
        used = [sum(s) for s in sizes]
        got = arena.attend_batch(0, qs, np.array(used))
        for b, (wk, wv) in enumerate(want):
            assert nmse(attention_ref.attend(qs[b], wk, wv, used[b]), got[b]) <= 1e-9
        return want, used

    q = rng.standard_normal((len(lengths), n_kv * g, hd)).astype(np.float32)
    check(q)
    t = [sum(s) for s in sizes]  # step_batch: a token a sequence, each at its own position
    out = arena.step_batch(0, np.stack([k[b][:, t[b]:t[b] + 1] for b in range(3)]),
                           np.stack([v[b][:, t[b]:t[b] + 1] for b in range(3)]), q)
    for s in sizes:
        s.append(1)
    want, used = check(q)
    for b, (wk, wv) in enumerate(want):
        assert nmse(attention_ref.attend(q[b], wk, wv, used[b]), out[b]) <= 1e-9
    step = arena.record_step(n_kv * g, layers=[0], batch=len(lengths))  # a recorded step of the batch
    t = [sum(s) for s in sizes]
    got = step.run(np.stack([k[b][:, t[b]] for b in range(3)])[None], np.stack([v[b][:, t[b]] for b in range(3)])[None],
                   q[None])
    for s in sizes:
        s.append(1)
    want, used = check(q)
    for b, (wk, wv) in enumerate(want):
        assert nmse(attention_ref.attend(q[b], wk, wv, used[b]), got[0, b]) <= 1e-9
    step.free()


def test_gpu_encoder_codes_the_turned_back_keys(make_arena, activate):
    """KvArena(encoder="gpu") over keys coded before RoPE: the device codes the keys turned back
    to position 0 (append and step), so what it holds reconstructs like the CPU codec's."""
    hd, n_kv, g, n_ctx = 64, 2, 2, 300
    rng = np.random.default_rng(52)
    art = _art(rng, hd, KeyRope(10000.0, 64), ((8, 4), (8, 3)), n_kv)
    activate(art)
    gpu = make_arena(2, n_kv, hd, n_ctx, encoder="gpu")
    cpu = make_arena(2, n_kv, hd, n_ctx, encoder="cpu")
    x = [tuple(rng.standard_normal((n_kv, n, hd)).astype(np.float32) for _ in "kv") for n in (200, 1, 1, 30)]
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    for i, (k, v) in enumerate(x):
        for a in (gpu, cpu):
            if i % 2:
                a.step(0, k, v, q)
            else:
                a.append(0, k, v)
    k_all = np.concatenate([k for k, _ in x], 1)
    err_gpu, err_cpu = nmse(k_all, gpu.read(0)[0]), nmse(k_all, cpu.read(0)[0])
    assert abs(err_gpu - err_cpu) <= 1e-4 * err_cpu, (err_gpu, err_cpu)
    assert nmse(cpu.attend(0, q, 232), gpu.attend(0, q, 232)) <= 1e-6
