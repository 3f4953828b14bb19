"""KvArena.record_step: a decode step of several layers recorded once and replayed per token,
its per-step values (each sequence's n_used, the queries, the new K/V words) in buffers.

Each replay is checked against an arena fed the same tokens by append + attend (the
engine's own calls) and against the float64 reference over what the cache holds — from an
empty sequence on, at lengths that change the splits, for every sequence of a batch, and
after the launch shape was planned at a length far from the replayed one. Every arena is
guarded (conftest.make_arena verifies the sentinels after each test), so a row written at the
wrong position shows.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_artifact
from kvdict_vk import codec
from kvdict_vk import errors as E
from kvdict_vk import kivi as K
from kvdict_vk import rows as R
from kvdict_vk import runtime
from kvdict_vk.cli.validate import NMSE_FAST  # the fast paths' gate (issue #50)
from kvdict_vk.metrics import nmse
from kvdict_vk.vk import kernels
from kvdict_vk.vk.attend.flash import MMA_KERNEL
from kvdict_vk.vk.attend.specs import dynamic_split_len
from test_vk_attend import reference

pytestmark = pytest.mark.gpu


def _tokens(rng, n_layers, batch, n_kv, hd, n_heads):
    """One step's (K, V, q): float32 (n_layers, batch, heads, head_dim)."""
    k = rng.standard_normal((n_layers, batch, n_kv, hd), dtype=np.float32)
    v = rng.standard_normal((n_layers, batch, n_kv, hd), dtype=np.float32)
    q = rng.standard_normal((n_layers, batch, n_heads, hd), dtype=np.float32)
    return k, v, q


def _replay_beside_step(stepped, plain, step, rng, n_heads, keys, vals):
    """One token of every layer through ``step`` (recorded on ``stepped``) and through
    KvArena.step on its twin ``plain``: outputs equal (1e-9), token counts equal; the token's
    rows appended to keys / vals [layer]. Returns (q, the step's output)."""
    lay = stepped.layout
    k, v, q = _tokens(rng, lay.n_layers, 1, lay.n_kv_heads, lay.head_dim, n_heads)
    got = step.run(k, v, q)
    assert got.shape == q.shape and got.dtype == np.float32
    for layer in range(lay.n_layers):
        want = plain.step(layer, k[layer].transpose(1, 0, 2), v[layer].transpose(1, 0, 2), q[layer, 0])
        keys[layer].append(k[layer].transpose(1, 0, 2))
        vals[layer].append(v[layer].transpose(1, 0, 2))
        assert stepped.n_tokens(layer) == plain.n_tokens(layer)
        assert nmse(want, got[layer, 0]) <= 1e-9, f"layer {layer}, {stepped.n_tokens(layer)} tokens"
    return q, got


def _prefill(arenas, rng, n_layers, n_kv, hd, lengths):
    """lengths[s] random tokens appended to sequence s of every layer of every arena; returns
    [layer][seq] → (K, V) float32 (n_kv, T, hd) appended."""
    held = []
    for layer in range(n_layers):
        per_seq = []
        for s, n in enumerate(lengths):
            k = rng.standard_normal((n_kv, n, hd), dtype=np.float32)
            v = rng.standard_normal((n_kv, n, hd), dtype=np.float32)
            for a in arenas:
                if n:
                    a.append(layer, k, v, seq=s)
            per_seq.append((k, v))
        held.append(per_seq)
    return held


@pytest.mark.parametrize("cache", ["f16", "f32", "q8_0"])
def test_replays_equal_append_then_attend(cache, make_arena):
    """Three layers, from an empty cache (the first token attends over itself) past several
    split lengths: every replay equals KvArena.step on a twin arena and the float64 reference
    over the rows the cache holds; the tokens really are in the layers afterwards."""
    n_layers, n_kv, g, hd, n_ctx = 3, 2, 3, 64, 400
    rng = np.random.default_rng(41)
    stepped, plain = make_arena(n_layers, n_kv, hd, n_ctx, cache=cache), make_arena(n_layers, n_kv, hd, n_ctx,
                                                                                   cache=cache)
    step = stepped.record_step(n_kv * g)
    keys = [[] for _ in range(n_layers)]
    vals = [[] for _ in range(n_layers)]
    for t in range(1, 9):
        if t == 4:  # a long stretch between replays: the splits' length changes
            k, v = (rng.standard_normal((n_kv, 250, hd), dtype=np.float32) for _ in range(2))
            for layer in range(n_layers):
                stepped.append(layer, k, v)
                plain.append(layer, k, v)
                keys[layer].append(k)
                vals[layer].append(v)
        q, got = _replay_beside_step(stepped, plain, step, rng, n_kv * g, keys, vals)
        for layer in range(n_layers):
            n = stepped.n_tokens(layer)
            k_all, v_all = (R.held_rows(np.concatenate(x, 1), cache) for x in (keys[layer], vals[layer]))
            assert nmse(reference(q[layer, 0], k_all, v_all, None, None, n), got[layer, 0]) <= 1e-9
    for layer in range(n_layers):  # the appended rows, read back, are the plain arena's
        for a, b in zip(stepped.read(layer), plain.read(layer)):
            np.testing.assert_array_equal(a, b)


def _awkward_rows(rng, shape, cache):
    """float32 rows whose conversion is easy to get wrong. f16: NaNs with payloads, ±inf, ±0,
    float32 subnormals, the binary16 subnormal range and its ties (2^-25 and its neighbours),
    the largest binary16 and what rounds past it, exact ties between binary16 neighbours, and
    random bit patterns over every exponent. q8_0 (finite input, normal magnitudes): an
    all-zero block, a block whose scale is exactly 1 (its values on the .5 ties), huge and
    tiny blocks, signed zeros, random bits over a wide range of exponents."""
    n = int(np.prod(shape))
    if cache == "f16":
        special = np.array([0x7F800001, 0xFFC00000, 0x7F802001, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0x0, 0x80000000,
                            0x00000001, 0x807FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF, 0xB3000000, 0x387FE000,
                            0x38800000, 0x38801000, 0x38803000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000,
                            0x477FFFFF, 0x47800000, 0x7F7FFFFF, 0x3F801000, 0x3F803000, 0x3F800FFF, 0x35000001,
                            0x34FFF000, 0x35800800, 0x35801800], np.uint32)
        bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        bits[:special.size] = special
        bits[special.size:2 * special.size] = special ^ 0x80000000
        return bits.view(np.float32).reshape(shape)
    mag = np.exp2(rng.uniform(-100, 100, n)).astype(np.float32) * rng.choice([-1, 1], n).astype(np.float32)
    x = mag.reshape(-1, 32)
    x[0] = 0
    x[1] = np.arange(-15.5, 16.5, 1, dtype=np.float32) * np.float32(127 / 16)  # d near 1: ties
    x[2] = np.arange(32, dtype=np.float32) - np.float32(16.5)
    x[2, 0] = 127  # d exactly 1: every other value a .5 tie
    x[3] = rng.standard_normal(32).astype(np.float32) * np.float32(3e37)
    x[4] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-30)
    x[5, ::2] = -0.0
    return x.reshape(shape)


@pytest.mark.parametrize("cache,hd", [("f16", 64), ("f16", 8), ("q8_0", 32), ("q8_0", 128)])
def test_the_device_converts_rows_as_numpy_does(cache, hd, make_arena):
    """append_step turns the step's float32 rows into the cache's words on the device
    (rows_encode.glsl): the layers' words, read back raw, equal a twin arena's whose appends
    converted the same rows with NumPy (rows.row_words_of) — NaN payloads, infinities,
    subnormals and ties included for binary16; q8_0's scales, its .5 ties, an odd number of
    blocks (head_dim 32: one scale in a word) and an all-zero block."""
    n_layers, n_kv, batch, n_ctx = 2, 2, 2, 48
    rng = np.random.default_rng(48)
    stepped = make_arena(n_layers, n_kv, hd, n_ctx, cache=cache, seqs=batch)
    plain = make_arena(n_layers, n_kv, hd, n_ctx, cache=cache, seqs=batch)
    step = stepped.record_step(n_kv, batch=batch)
    for _ in range(3):
        k, v = (_awkward_rows(rng, (n_layers, batch, n_kv, hd), cache) for _ in range(2))
        step.run(k, v, rng.standard_normal((n_layers, batch, n_kv, hd), dtype=np.float32))
        for layer in range(n_layers):
            for s in range(batch):
                plain.append(layer, k[layer, s][:, None], v[layer, s][:, None], seq=s)
    for layer in range(n_layers):
        got, want = stepped.memory.layer_words(layer), plain.memory.layer_words(layer)
        bad = np.flatnonzero(got != want)
        assert not bad.size, f"layer {layer}: {bad.size} words differ, first at {bad[:4]}: " \
                             f"{[hex(x) for x in got[bad[:4]]]} != {[hex(x) for x in want[bad[:4]]]}"


@pytest.mark.parametrize("batch", [3, 2])
def test_batched_replays_equal_reference(batch, make_arena):
    """A batch of sequences of unequal lengths (one empty), each appended at its own row
    and attending over its own tokens; batch < seqs leaves the last sequence untouched."""
    n_layers, n_kv, g, hd, n_ctx, seqs = 2, 2, 2, 64, 300, 3
    rng = np.random.default_rng(42)
    arena = make_arena(n_layers, n_kv, hd, n_ctx, cache="f16", seqs=seqs)
    held = _prefill([arena], rng, n_layers, n_kv, hd, [0, 129, 40])
    step = arena.record_step(n_kv * g, batch=batch)
    for _ in range(3):
        k, v, q = _tokens(rng, n_layers, batch, n_kv, hd, n_kv * g)
        got = step.run(k, v, q)
        for layer in range(n_layers):
            for s in range(batch):
                hk, hv = held[layer][s]
                held[layer][s] = (np.concatenate([hk, k[layer, s][:, None]], 1),
                                  np.concatenate([hv, v[layer, s][:, None]], 1))
                n = arena.n_tokens(layer, s)
                assert n == held[layer][s][0].shape[1]
                ref = reference(q[layer, s], *(R.held_rows(x, "f16") for x in held[layer][s]), None, None, n)
                assert nmse(ref, got[layer, s]) <= 1e-9, f"layer {layer}, sequence {s}"
    assert all(arena.n_tokens(layer, 2) == 40 for layer in range(n_layers)) or batch == 3


def test_dict_coded_replays_equal_the_codes_reference(make_arena, activate):
    """Both streams dict-coded (per-head dictionaries, residual stages): the step codes its
    tokens on the host (codec.encode_heads) and attend_flash_coded attends over the slots;
    equal to the float64 reference over the codes and to KvArena.step on a twin arena."""
    n_layers, n_kv, g, hd, n_ctx = 2, 2, 3, 64, 300
    rng = np.random.default_rng(43)
    activate(random_artifact(rng, hd, 128, [((4, 4), (4, 3))] * n_layers, n_heads=n_kv))
    stepped, plain = make_arena(n_layers, n_kv, hd, n_ctx), make_arena(n_layers, n_kv, hd, n_ctx)
    assert stepped.mode == "dict"
    plain.attention(n_kv * g).path = "flash"
    held = _prefill([stepped, plain], rng, n_layers, n_kv, hd, [150])
    step = stepped.record_step(n_kv * g)
    for _ in range(2):
        k, v, q = _tokens(rng, n_layers, 1, n_kv, hd, n_kv * g)
        got = step.run(k, v, q)
        for layer in range(n_layers):
            kd, vd = runtime.clone_layer_dict(layer, True), runtime.clone_layer_dict(layer, False)
            rows = [r.transpose(1, 0, 2) for r in (k[layer], v[layer])]
            want = plain.step(layer, *rows, q[layer, 0])
            assert nmse(want, got[layer, 0]) <= 1e-9
            held[layer][0] = tuple(np.concatenate([h, r], 1) for h, r in zip(held[layer][0], rows))
            codes = [codec.encode_heads(x, d) for x, d in zip(held[layer][0], (kd, vd))]
            n = stepped.n_tokens(layer)
            assert nmse(reference(q[layer, 0], *codes, kd, vd, n), got[layer, 0]) <= 1e-9


def test_planned_short_replayed_long_and_a_layer_subset(make_arena):
    """The launch shape planned at 64 tokens, replayed at 500 (the splits grow with n_used:
    attend_common.glsl's SPLIT_LEN), over layers 2 and 0 only, in that order; layer 1 is
    left as it was."""
    n_kv, g, hd, n_ctx = 2, 4, 64, 600
    rng = np.random.default_rng(44)
    stepped, plain = make_arena(3, n_kv, hd, n_ctx, cache="f32"), make_arena(3, n_kv, hd, n_ctx, cache="f32")
    _prefill([stepped, plain], rng, 3, n_kv, hd, [20])
    step = stepped.record_step(n_kv * g, layers=[2, 0], n_plan=64)
    for n_long in (0, 470):
        if n_long:
            k, v = (rng.standard_normal((n_kv, n_long, hd), dtype=np.float32) for _ in range(2))
            for a in (stepped, plain):
                a.append(0, k, v)
                a.append(2, k, v)
        k, v, q = _tokens(rng, 2, 1, n_kv, hd, n_kv * g)
        got = step.run(k, v, q)
        for j, layer in enumerate((2, 0)):
            want = plain.step(layer, k[j].transpose(1, 0, 2), v[j].transpose(1, 0, 2), q[j, 0])
            assert nmse(want, got[j, 0]) <= 1e-9, f"layer {layer} at {stepped.n_tokens(layer)} tokens"
    assert stepped.n_tokens(1) == 20


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_in_place_replays_equal_run(cache, make_arena, activate):
    """inputs() are the step's own buffers: values written there and replay() give what run()
    gives a twin arena; the output is a view the next replay overwrites. A dict-coded step
    codes its rows in run(): inputs()/replay() refuse it, as a freed step refuses."""
    n_layers, n_kv, g, hd, n_ctx, batch = 2, 2, 3, 64, 90, 2
    rng = np.random.default_rng(49)
    a, b = (make_arena(n_layers, n_kv, hd, n_ctx, cache=cache, seqs=batch) for _ in range(2))
    _prefill([a, b], rng, n_layers, n_kv, hd, [30, 5])
    in_place, copied = a.record_step(n_kv * g, batch=batch), b.record_step(n_kv * g, batch=batch)
    k_in, v_in, q_in = in_place.inputs()
    outs = []
    for _ in range(3):
        k, v, q = _tokens(rng, n_layers, batch, n_kv, hd, n_kv * g)
        k_in[:], v_in[:], q_in[:] = k, v, q
        got = in_place.replay()
        np.testing.assert_array_equal(got, copied.run(k, v, q))
        outs.append((got, got.copy()))
    assert outs[0][0] is outs[-1][0] and not np.array_equal(outs[0][1], outs[-1][0])
    for layer in range(n_layers):
        for x, y in zip(a.read(layer), b.read(layer)):
            np.testing.assert_array_equal(x, y)
    in_place.free()
    for call in (in_place.inputs, in_place.replay):
        with pytest.raises(E.ArenaError):
            call()
    activate(random_artifact(rng, hd, 64, [((4, 4), (4, 3))] * n_layers, n_heads=n_kv))
    coded = make_arena(n_layers, n_kv, hd, n_ctx).record_step(n_kv * g)
    for call in (coded.inputs, coded.replay):
        with pytest.raises(E.ArenaError, match="dict-coded"):
            call()


def test_dynamic_split_length_twin():
    """specs.dynamic_split_len (SPLIT_LEN's twin) covers n_used in whole rounds, never more
    than a round past an even split."""
    for n_used in (1, 2, 31, 32, 33, 1000, 131072):
        for n_splits in (1, 3, 64):
            for rnd in (1, 16, 32, 96):
                s = dynamic_split_len(n_used, n_splits, rnd)
                assert s % rnd == 0 and s * n_splits >= n_used and s - rnd < -(-n_used // n_splits)


def test_a_replay_makes_no_pipeline(make_arena):
    """Replays build nothing: the device's pipelines are those the recording made."""
    arena = make_arena(2, 2, 64, 200, cache="f16")
    rng = np.random.default_rng(45)
    step = arena.record_step(4)
    step.run(*_tokens(rng, 2, 1, 2, 64, 4))
    before = kernels.pipeline_count(arena.device)
    for _ in range(3):
        step.run(*_tokens(rng, 2, 1, 2, 64, 4))
    assert kernels.pipeline_count(arena.device) == before


def test_bad_input_leaves_the_arena_as_it_was(make_arena):
    """Wrong shapes or dtypes are a ShapeError, a full sequence an ArenaError — before any
    word is written: the token counts stay and a later replay is still exact. A freed step
    (or a freed arena's) refuses to run."""
    n_kv, g, hd, n_ctx = 2, 2, 64, 40
    rng = np.random.default_rng(46)
    stepped, plain = make_arena(2, n_kv, hd, n_ctx, cache="f16"), make_arena(2, n_kv, hd, n_ctx, cache="f16")
    _prefill([stepped, plain], rng, 2, n_kv, hd, [38])
    step = stepped.record_step(n_kv * g)
    k, v, q = _tokens(rng, 2, 1, n_kv, hd, n_kv * g)
    for bad in (dict(k=k[:1]), dict(v=v.astype(np.float64)), dict(q=q[:, :, :3]), dict(q=list(q))):
        args = {**dict(k=k, v=v, q=q), **bad}
        with pytest.raises(E.ShapeError):
            step.run(args["k"], args["v"], args["q"])
        assert stepped.n_tokens(0) == stepped.n_tokens(1) == 38
    stepped.append(1, k[1].transpose(1, 0, 2), v[1].transpose(1, 0, 2))  # layer 1 one ahead
    plain.append(1, k[1].transpose(1, 0, 2), v[1].transpose(1, 0, 2))
    got = step.run(k, v, q)  # layer 1's sequence is now full
    with pytest.raises(E.ArenaError, match="full"):
        step.run(k, v, q)
    assert (stepped.n_tokens(0), stepped.n_tokens(1)) == (39, 40)
    want = plain.step(0, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2), q[0, 0])
    assert nmse(want, got[0, 0]) <= 1e-9
    step.free()
    assert step.closed
    with pytest.raises(E.ArenaError):
        step.run(k, v, q)
    other = stepped.record_step(n_kv * g, layers=[0])
    stepped.free()
    assert other.closed


@pytest.mark.parametrize("bits,recent", [((4, 4), 8), ((3, 5), 0), ((2, 8), 40)])
def test_kivi_replays_quantise_on_the_device_as_the_host_does(bits, recent, make_arena):
    """A KIVI cache's recorded step: each token into the exact windows on the device and, as a
    group leaves them, the group quantised there (append_kivi.comp). Over steps that cross
    several groups' exits (recent 0: the new token's own group) every replay equals
    KvArena.step on a twin arena (the host's quantiser), the layers' words are the twin's bit
    for bit, the output is the float64 reference over the rows the cache holds; then a host
    append after the device's (reading the window back) and more replays stay equal."""
    n_layers, n_kv, g, hd, n_ctx = 2, 2, 3, 64, 400
    spec = K.KiviSpec(*bits, recent)
    rng = np.random.default_rng(53 + recent)
    stepped, plain = (make_arena(n_layers, n_kv, hd, n_ctx, cache="kivi", kivi=spec) for _ in range(2))
    step = stepped.record_step(n_kv * g)
    keys, vals = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]

    def host_append(n):
        k, v = (rng.standard_normal((n_kv, n, hd), dtype=np.float32) * 3 for _ in range(2))
        for layer in range(n_layers):
            stepped.append(layer, k, v)
            plain.append(layer, k, v)
            keys[layer].append(k)
            vals[layer].append(v)

    host_append(21)
    for t in range(90):
        if t == 50:
            host_append(37)  # the host quantises from the window the device filled
        q, got = _replay_beside_step(stepped, plain, step, rng, n_kv * g, keys, vals)
        for layer in range(n_layers):
            n = stepped.n_tokens(layer)
            if t % 16 == 15 or t == 89:
                kc, vc = K.cache_rows(np.concatenate(keys[layer], 1), np.concatenate(vals[layer], 1), n, spec)
                assert nmse(reference(q[layer, 0], kc, vc, None, None, n), got[layer, 0]) <= 1e-9
    _assert_kivi_words_equal(stepped, plain, recent)


def _assert_kivi_words_equal(stepped, plain, recent):
    """Every layer's words of two KIVI arenas equal bit for bit, state words included, but for
    the windows' slots of quantised tokens (dead: never read)."""
    for layer in range(stepped.layout.n_layers):
        a, b = stepped.memory.layer_words(layer), plain.memory.layer_words(layer)
        ll, n = stepped.layout.layers[layer], stepped.n_tokens(layer)
        q_end = K.quantised_end(n, recent)
        assert a[ll.k.state_word] == b[ll.k.state_word] == q_end
        live = np.ones(a.size, bool)
        for st in ll.streams:
            ring = np.arange(st.window_word, st.window_word + st.window_words).reshape(
                stepped.layout.n_kv_heads, st.window_tokens, -1)
            live[ring] = False
            live[ring[:, np.arange(q_end, n) % st.window_tokens]] = True
        np.testing.assert_array_equal(a[live], b[live])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_kivi_device_quantiser_rounds_ties_as_the_host_does(head_dim, make_arena):
    """Rows where a level's quotient is a tie: 4 bits, each key group holding a token of 0s and
    one of 15s, each value dim group a 0 and a 15 — a scale of exactly 1 — and every other
    element a multiple of 0.5 in [0, 15], so half of them quotients k + 0.5 (roundEven's ties,
    which append_kivi.comp settles by the correctly rounded quotient). Replayed steps quantise
    groups on the device; the words equal the host quantiser's bit for bit."""
    n_kv, g, spec = 2, 2, K.KiviSpec(4, 4, 0)
    rng = np.random.default_rng(71)
    stepped, plain = (make_arena(1, n_kv, head_dim, 160, cache="kivi", kivi=spec) for _ in range(2))
    step = stepped.record_step(n_kv * g)
    ties = 0
    for t in range(100):
        k, v = (rng.integers(0, 31, (n_kv, head_dim)).astype(np.float32) * np.float32(0.5) for _ in range(2))
        if t % K.GROUP < 2:
            k[:] = 15.0 * (t % K.GROUP)
        v[:, ::K.GROUP], v[:, 1::K.GROUP] = 0.0, 15.0
        ties += int(np.count_nonzero(k % 1 == 0.5) + np.count_nonzero(v % 1 == 0.5))
        q = rng.standard_normal((n_kv * g, head_dim), dtype=np.float32)
        got = step.run(k[None, None], v[None, None], q[None, None])
        want = plain.step(0, k[:, None], v[:, None], q)
        assert nmse(want, got[0, 0]) <= 1e-9
    assert stepped.n_tokens(0) == 100 and ties > 1000
    _assert_kivi_words_equal(stepped, plain, spec.recent)


def test_kivi_heads_wider_than_the_projections_stage_keep_the_steps_append(make_arena):
    """fwd_qkv quantises a KIVI group in its matvec stage (rows.QKV_KIVI_MAX_HEAD_DIM): a step
    over wider heads offers no row_append — a forward records append_kivi there."""
    from kvdict_vk import rows as R
    for hd in (R.QKV_KIVI_MAX_HEAD_DIM, 2 * R.QKV_KIVI_MAX_HEAD_DIM):
        arena = make_arena(1, 1, hd, 64, cache="kivi")
        step = arena.record_step(2, record=False)
        assert (step.row_append(0) is None) == (hd > R.QKV_KIVI_MAX_HEAD_DIM)
        step.free()


def test_kivi_plans_are_timed_with_a_decodes_window(make_arena, monkeypatch):
    """Where the engine times launch shapes, a recorded step's KIVI layers are timed with each
    sequence's quantised end where a cache of n_plan tokens has it (not the arena's own: an
    empty arena would put the whole context in the exact window's split), and hold their own
    state words again afterwards — every sequence's, the uncoded layer untouched."""
    from kvdict_vk.vk.attend.engine import Attention
    recent, n_plan, n_seqs = 8, 100, 3
    arena = make_arena(2, 1, 32, 128, cache="kivi", kivi=K.KiviSpec(4, 4, recent), seqs=n_seqs)
    rng = np.random.default_rng(48)
    for s, n in enumerate((0, 45, 70)):  # quantised ends 0, 32, 32 (whole groups past the window)
        if n:
            for layer in range(2):
                arena.append(layer, *rng.standard_normal((2, 1, n, 32), dtype=np.float32), seq=s)
    st = [arena.layout.layers[i].k for i in range(2)]
    before = [arena.layer_words(i)[st[i].state_word:st[i].state_word + n_seqs].copy() for i in range(2)]
    assert before[0].tolist() == [0, 32, 32]
    seen = []

    def timed(self, layer, n_used, plan):
        seen.append((layer, n_used, arena.layer_words(layer)[st[layer].state_word:st[layer].state_word + n_seqs]))
        return 1e-6
    monkeypatch.setattr(Attention, "times_plans", property(lambda self: True))
    monkeypatch.setattr(Attention, "time_plan", timed)
    step = arena.record_step(2, batch=n_seqs, n_plan=n_plan, record=False)
    assert seen and all(n == n_plan and words.tolist() == [K.quantised_end(n_plan, recent)] * n_seqs
                        for _, n, words in seen)
    for i in range(2):
        assert np.array_equal(arena.layer_words(i)[st[i].state_word:st[i].state_word + n_seqs], before[i])
    step.free()


def test_refusals(make_arena, activate):
    """What a recorded step cannot serve is a typed error at record time, before anything is
    allocated: a layer coded in one stream only, a batch beyond the arena's sequences,
    repeated layers, n_plan beyond the capacity."""
    rng = np.random.default_rng(47)
    rows = make_arena(2, 2, 64, 128, cache="f16")
    for kw in (dict(batch=2), dict(layers=[0, 0]), dict(n_plan=129), dict(layers=[])):
        with pytest.raises(E.ArenaError):
            rows.record_step(4, **kw)
    with pytest.raises(E.LayerIndexError):
        rows.record_step(4, layers=[2])
    activate(random_artifact(rng, 64, 64, [((4, 4), None)], n_heads=2))
    mixed = make_arena(1, 2, 64, 128)
    with pytest.raises(E.ArenaError, match="both"):
        mixed.record_step(4)


def test_replays_through_attend_mma_where_the_device_has_it(make_arena):
    """Attention.flash_kernel = "mma": the recorded step attends by attend_mma (its splits
    whole tiles, SPLIT_LEN in rounds of them), at the fast paths' gate; where the device lacks
    cooperative matrices, recording it is the typed refusal."""
    n_kv, g, hd, n_ctx = 2, 4, 64, 700
    rng = np.random.default_rng(48)
    arena = make_arena(2, n_kv, hd, n_ctx, cache="f16")
    held = _prefill([arena], rng, 2, n_kv, hd, [300])
    att = arena.attention(n_kv * g)
    att.flash_kernel, att.flash_workgroups = MMA_KERNEL, 256
    if not att.shapes.mma_locals(0):
        with pytest.raises(E.ArenaError):
            arena.record_step(n_kv * g)
        return
    step = arena.record_step(n_kv * g)
    k, v, q = _tokens(rng, 2, 1, n_kv, hd, n_kv * g)
    got = step.run(k, v, q)
    for layer in range(2):
        rows = [np.concatenate([h, x[layer].transpose(1, 0, 2)], 1) for h, x in zip(held[layer][0], (k, v))]
        ref = reference(q[layer, 0], *(R.held_rows(x, "f16") for x in rows), None, None, 301)
        assert nmse(ref, got[layer, 0]) <= NMSE_FAST
