"""The dictionary cache's exact window on the device (kvdict_vk.window, shaders/read_window.comp):
every read equals the slots' reconstruction with the window's tokens in binary16 across appends
of awkward sizes (the ring wrapping, prefills longer than the window, the sink), attention over
it matches the float64 reference, a recorded read follows the cache as it grows, guard words
stay intact, and what the window cannot serve yet is refused with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_artifact
from kvdict_vk import attention_ref, codec
from kvdict_vk import errors as E
from kvdict_vk.dictionary import KvDictArtifact
from kvdict_vk.metrics import nmse
from kvdict_vk.window import ExactWindow, cache_rows

CASES = [  # (head_dim, n_kv, n_ctx, window, streams, append sizes)
    (64, 3, 300, ExactWindow(1, 32), ((4, 6), (4, 4)), (1, 1, 40, 1, 100, 3, 70)),
    (32, 2, 200, ExactWindow(4, 5), ((3, 0), None), (2, 1, 9, 1, 1, 60, 7)),  # V passthrough, K windowed
    (64, 1, 150, ExactWindow(0, 16), ((2, 3), (2, 2)), (150,)),  # one prefill longer than the window
    (16, 2, 120, ExactWindow(3, 0), ((2, 4), (2, 4)), (1, 1, 1, 1, 50)),  # a sink only
]


def _windowed(art: KvDictArtifact, window: ExactWindow) -> KvDictArtifact:
    return KvDictArtifact(art.head_dim, art.n_atoms, art.sparsity, art.layers, window)


def _reference(art, layer, window, k, v, sizes):
    """What the cache holds after appends of ``sizes`` tokens: each append's rows coded as one
    batch by the CPU codec (as the arena's codec path does), decoded in float64, the window's
    tokens in binary16."""
    out = []
    for j, x in enumerate((k, v)):
        d = art.layers[layer][j]
        if d is None:
            out.append(x[:, :sum(sizes)].astype(np.float64))
            continue
        parts, t = [], 0
        for n in sizes:
            parts.append(codec.decode_heads(codec.encode_heads(x[:, t:t + n], d), d))
            t += n
        coded = np.concatenate(parts, axis=1)
        held = cache_rows(coded, x, window)
        out.append(held)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[0]}-kv{c[1]}-s{c[3].sink}r{c[3].recent}")
def test_reads_equal_the_reference_as_the_cache_grows(case, make_arena, activate):
    hd, n_kv, n_ctx, window, streams, sizes = case
    rng = np.random.default_rng(hd + n_ctx)
    art = _windowed(random_artifact(rng, hd, 64, [streams, (None, None)]), window)
    activate(art)
    arena = make_arena(2, n_kv, hd, n_ctx)
    assert arena.layout.layers[0].windowed and not arena.layout.layers[1].windowed
    assert arena.layer_words(0)[arena.layout.layers[0].k.state_word] == 0  # no token yet, guards around it
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    n = 0
    for i, size in enumerate(sizes):
        assert arena.append(0, k[:, n:n + size], v[:, n:n + size]) == n + size
        n += size
        want = _reference(art, 0, window, k, v, sizes[:i + 1])
        got = arena.read(0, 0, n)
        exact = window.exact(n)
        for j, (w, g) in enumerate(zip(want, got)):
            if art.layers[0][j] is not None:
                np.testing.assert_array_equal(g[:, exact], w[:, exact])  # binary16 values, bit for bit
            assert nmse(w, g) <= 1e-12
        t0 = n // 3  # a read of a middle range
        got = arena.read(0, t0, n)
        assert nmse(want[0][:, t0:], got[0]) <= 1e-12
    check_no_change = arena.read(1, 0, 0)
    assert check_no_change[0].shape == (n_kv, 0, hd)


# None: attend_direct on CPU drivers, attend_flash_coded on GPUs, beside attend_window; "flash":
# attend_flash_coded everywhere; "rows": read out (reconstruct + read_window), then attended
@pytest.mark.parametrize("path", [None, "flash", "rows"])
@pytest.mark.parametrize("group", [1, 3])
def test_attention_matches_the_reference_over_the_windowed_cache(group, path, make_arena, activate):
    hd, n_kv, n_ctx, window = 64, 2, 400, ExactWindow(1, 32)
    rng = np.random.default_rng(group)
    art = _windowed(random_artifact(rng, hd, 128, [((4, 6), (4, 4))], f16_atoms=True), window)
    activate(art)
    arena = make_arena(1, n_kv, hd, n_ctx)
    arena.attention(n_kv * group).path = path
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    k[:, 0] *= 4  # a sink token that draws attention
    sizes, n = [], 0
    for size in (37, 1, 1, 90, 1):
        q = rng.standard_normal((n_kv * group, hd)).astype(np.float32)
        out = arena.step(0, k[:, n:n + size], v[:, n:n + size], q)
        n += size
        sizes.append(size)
        kr, vr = _reference(art, 0, window, k, v, sizes)
        assert nmse(attention_ref.attend(q, kr, vr, n), out) <= 1e-9
        for n_used in (1, n // 2, n):
            got = arena.attend(0, q, n_used)
            assert nmse(attention_ref.attend(q, kr, vr, n_used), got) <= 1e-9
    # the window matters: the same attention over the slots alone differs
    coded = [codec.decode_heads(np.concatenate([codec.encode_heads(x[:, t0:t0 + s], d) for t0, s in
                                                zip(np.cumsum([0, *sizes[:-1]]), sizes)], axis=1), d)
             for x, d in zip((k, v), art.layers[0])]
    q = rng.standard_normal((n_kv * group, hd)).astype(np.float32)
    assert nmse(attention_ref.attend(q, *coded, n), arena.attend(0, q, n)) > 1e-7


# hd 24: the workgroup's 64 invocations are not whole row groups of 6 quads (no flash kernel fits it)
@pytest.mark.parametrize("path, hd", [(None, 32), ("flash", 32), (None, 24)])
def test_a_window_of_several_chunks(path, hd, make_arena, activate):
    """attend_window walks its rows in chunks of its workgroup (64): 2 + 150 rows, partly filled."""
    n_kv, group, window = 2, 2, ExactWindow(2, 150)
    rng = np.random.default_rng(3)
    art = _windowed(random_artifact(rng, hd, 64, [((3, 4), (3, 3))]), window)
    activate(art)
    arena = make_arena(1, n_kv, hd, 500)
    arena.attention(n_kv * group).path = path
    k = 2 * rng.standard_normal((n_kv, 500, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, 500, hd)).astype(np.float32)
    sizes, n = [], 0
    for size in (70, 60, 1, 200, 1):  # the window partly filled, then full, then the ring wrapping
        arena.append(0, k[:, n:n + size], v[:, n:n + size])
        n += size
        sizes.append(size)
        kr, vr = _reference(art, 0, window, k, v, sizes)
        q = rng.standard_normal((n_kv * group, hd)).astype(np.float32)
        for n_used in (n, max(1, n - 40)):
            assert nmse(attention_ref.attend(q, kr, vr, n_used), arena.attend(0, q, n_used)) <= 1e-9


def test_a_recorded_read_follows_the_window(make_arena, activate):
    """read_window takes the token count from the layer's state word: a read recorded early
    reads tokens that left the window later from their slots."""
    window = ExactWindow(1, 8)
    rng = np.random.default_rng(5)
    art = _windowed(random_artifact(rng, 32, 64, [((3, 4), (3, 4))]), window)
    activate(art)
    arena = make_arena(1, 1, 32, 64)
    k = rng.standard_normal((1, 64, 32)).astype(np.float32)
    v = rng.standard_normal((1, 64, 32)).astype(np.float32)
    arena.append(0, k[:, :12], v[:, :12])
    plan = arena.read_plan(0, 0, 12)
    first = plan.run()
    arena.append(0, k[:, 12:40], v[:, 12:40])
    again = plan.run()
    want = _reference(art, 0, window, k, v, [12, 28])
    assert nmse(want[0][:, :12], again[0]) <= 1e-12
    assert np.array_equal(first[0][:, 0], again[0][:, 0])  # the sink stays exact
    assert not np.array_equal(first[0][:, 4:12], again[0][:, 4:12])  # exact then, coded now


def test_a_recorded_step_appends_into_the_window_and_attends(make_arena, activate):
    """record_step over a windowed layer: append_window writes the token's binary16 rows and the
    state word on the device, attend_flash_coded skips the window and attend_window attends it;
    every step's output matches the reference and the cache reads back as the host's appends
    would have left it."""
    hd, n_kv, group, n_ctx, window = 64, 2, 2, 120, ExactWindow(1, 8)
    rng = np.random.default_rng(11)
    art = _windowed(random_artifact(rng, hd, 64, [((4, 6), (4, 4)), ((4, 6), (4, 4))], f16_atoms=True), window)
    activate(art)
    arena = make_arena(2, n_kv, hd, n_ctx)
    k = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    for layer in range(2):
        arena.append(layer, k[layer, :, :5], v[layer, :, :5])
    step = arena.record_step(n_kv * group)
    sizes = [5]
    for t in range(5, 20):  # the ring wraps twice
        q = rng.standard_normal((2, 1, n_kv * group, hd)).astype(np.float32)
        out = step.run(k[:, None, :, t], v[:, None, :, t], q)
        sizes.append(1)
        for layer in range(2):
            kr, vr = _reference(art, layer, window, k[layer], v[layer], sizes)
            assert nmse(attention_ref.attend(q[layer, 0], kr, vr, t + 1), out[layer, 0]) <= 1e-9
    for layer in range(2):
        assert arena.n_tokens(layer) == 20
        want = _reference(art, layer, window, k[layer], v[layer], sizes)
        got = arena.read(layer)
        for w, g in zip(want, got):
            assert nmse(w, g) <= 1e-12
            np.testing.assert_array_equal(g[:, window.exact(20)], w[:, window.exact(20)])


def test_what_the_window_does_not_serve_is_refused(make_arena, activate, vk_device):
    from kvdict_vk.vk import KvArena
    rng = np.random.default_rng(9)
    art = _windowed(random_artifact(rng, 32, 64, [((3, 4), (3, 4))]), ExactWindow(1, 8))
    activate(art)
    with pytest.raises(E.ArenaError, match="one sequence"):
        KvArena(1, 2, 32, 64, device=vk_device, seqs=2)
    arena = make_arena(1, 2, 32, 64)
    k = rng.standard_normal((2, 20, 32)).astype(np.float32)
    arena.append(0, k[:, :10], k[:, :10])
    before = arena.layer_words(0)
    slots = codec.encode_heads(k[:, 10:12], art.layers[0][0])
    with pytest.raises(E.ArenaError, match="float32 rows too"):
        arena.append_codes(0, slots, slots)
    with pytest.raises(E.ShapeError, match="tokens' rows"):
        arena.append_codes(0, slots, slots, rows=(k[:, 10:13], k[:, 10:13]))
    att = arena.attention(2)
    with pytest.raises(E.ArenaError, match="windowed dictionary layer"):
        att.plan(0, 10, path="table")
    assert np.array_equal(before, arena.layer_words(0)) and arena.n_tokens(0) == 10


def test_append_codes_with_rows_equals_append(make_arena, activate):
    """Codes made elsewhere (codec.encode_heads) with their rows: the same layer as append's."""
    rng = np.random.default_rng(4)
    art = _windowed(random_artifact(rng, 32, 64, [((3, 4), (3, 4))]), ExactWindow(2, 6))
    activate(art)
    a, b = make_arena(1, 2, 32, 64), make_arena(1, 2, 32, 64)
    k = rng.standard_normal((2, 30, 32)).astype(np.float32)
    v = rng.standard_normal((2, 30, 32)).astype(np.float32)
    for t0, t1 in ((0, 1), (1, 9), (9, 30)):
        a.append(0, k[:, t0:t1], v[:, t0:t1])
        codes = [codec.encode_heads(x[:, t0:t1], d) for x, d in zip((k, v), art.layers[0])]
        b.append_codes(0, *codes, rows=(k[:, t0:t1], v[:, t0:t1]))
        assert np.array_equal(a.layer_words(0), b.layer_words(0))


def test_the_benchmarks_fill_a_windowed_arena(make_arena, activate):
    """bench.decode_step.fill_random (the benchmarks' and probes' filler: random slots) hands a
    windowed layer its rows: the window's tokens read back as those rows in binary16."""
    from kvdict_vk.bench.decode_step import fill_random
    rng = np.random.default_rng(5)
    art = _windowed(random_artifact(rng, 32, 64, [((3, 4), (3, 4))] * 2), ExactWindow(1, 8))
    activate(art)
    arena = make_arena(2, 2, 32, 100)
    fill_random(arena, np.random.default_rng(6), 40)
    rows = np.random.default_rng(6).standard_normal((2, 40, 32), dtype=np.float32)  # fill_random's first draw
    for layer in range(2):
        k, v = arena.read(layer)
        for x in (k, v):
            held = [0, *range(32, 40)]  # the sink and the 8 most recent tokens
            assert np.array_equal(x[:, held], rows[:, held].astype(np.float16).astype(np.float32))


def test_the_layout_places_a_window_block_and_a_state_word(activate):
    from kvdict_vk import layout as L
    art = _windowed(random_artifact(np.random.default_rng(0), 64, 32, [((4, 6), None)]), ExactWindow(1, 32))
    lay = L.build_layout(1, 3, 64, 1000, art)
    k, v = lay.layers[0].streams
    assert k.windowed and not v.windowed and k.window_tokens == 33
    assert k.window_words == 3 * 33 * 32 and v.window_word is None
    assert k.window_word >= v.region_word + v.region_words and k.state_word > k.window_word
    assert lay.layers[0].tail_word > k.state_word  # the atoms stay at the slice's tail
    assert k.to_dict()["exact_window"] == {"sink": 1, "recent": 32}
    with pytest.raises(E.DictMismatchError, match="odd"):
        L.build_layout(1, 1, 63, 10, _windowed(random_artifact(np.random.default_rng(0), 63, 32, [((4, 0), None)]),
                                               ExactWindow(1, 4)))
