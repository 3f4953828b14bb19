"""The KIVI cache on the device (KvArena(cache="kivi"), shaders/read_rows_kivi.comp): every
read equals kvdict_vk.kivi.cache_rows bit for bit across appends of awkward sizes (the
exact window's ring wrapping, groups quantised as they age), attention and decode steps
match the float64 reference over those rows, guard words stay intact, and bad input is
refused with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_guards
from kvdict_vk import attention_ref
from kvdict_vk import errors as E
from kvdict_vk import kivi as K
from kvdict_vk.metrics import nmse

CASES = [  # (head_dim, n_kv, n_ctx, spec, append sizes)
    (64, 3, 500, K.KiviSpec(4, 4, 128), (1, 31, 33, 100, 1, 1, 200, 50, 83)),
    (64, 2, 300, K.KiviSpec(2, 3, 0), (7, 25, 32, 1, 200, 35)),  # no recent window: only the open group exact
    (32, 1, 1000, K.KiviSpec(8, 5, 33), (900, 1, 99)),  # one big append: many groups at once, the ring wraps
    (128, 2, 97, K.KiviSpec(3, 2, 5), (40, 40, 17)),  # n_ctx not whole groups: the last stays exact
    (32, 1, 5000, K.KiviSpec(4, 4, 128), (4500, 1, 499)),  # values quantised in several slices
]


def _rows(rng, n_kv, n_ctx, hd):
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32) * 2
    k[:, :, 3] += 10  # an outlier channel, what per-channel keys are for
    return k, rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[0]}-kv{c[1]}-ctx{c[2]}-k{c[3].k_bits}v{c[3].v_bits}r{c[3].recent}")
def test_reads_equal_the_reference_as_the_cache_grows(case, make_arena):
    hd, n_kv, n_ctx, spec, steps = case
    rng = np.random.default_rng(hd + n_ctx)
    k, v = _rows(rng, n_kv, n_ctx, hd)
    arena = make_arena(2, n_kv, hd, n_ctx, cache="kivi", kivi=spec)
    assert arena.mode == "kivi" and arena.layout.kivi == spec
    n = 0
    for step in steps:
        assert arena.append(1, k[:, n:n + step], v[:, n:n + step]) == n + step
        n += step
        kr, vr = K.cache_rows(k, v, n, spec)
        kg, vg = arena.read(1, 0, n)
        np.testing.assert_array_equal(kg, kr)
        np.testing.assert_array_equal(vg, vr)
        t0 = n // 3  # a read of a middle range
        kg, vg = arena.read(1, t0, n)
        np.testing.assert_array_equal(vg, vr[:, t0:])
    assert arena.n_tokens(0) == 0
    check_guards(arena)


def test_a_recorded_read_stays_right_as_groups_are_quantised(make_arena):
    """The read shader takes the quantised end from the layer's state word, so a recording
    made early reads tokens that left the window later from their quantised rows."""
    spec = K.KiviSpec(4, 4, 16)
    rng = np.random.default_rng(1)
    k, v = _rows(rng, 2, 200, 64)
    arena = make_arena(1, 2, 64, 200, cache="kivi", kivi=spec)
    arena.append(0, k[:, :40], v[:, :40])
    plan = arena.read_plan(0, 0, 40)
    first = plan.run()  # recorded: the same command buffer runs again below
    arena.append(0, k[:, 40:200], v[:, 40:200])  # tokens 0..39 are quantised now, the ring rewritten
    kr, vr = K.cache_rows(k, v, 200, spec)
    again = plan.run()
    np.testing.assert_array_equal(again[0], kr[:, :40])
    np.testing.assert_array_equal(again[1], vr[:, :40])
    np.testing.assert_array_equal(first[0], K.cache_rows(k, v, 40, spec)[0])
    assert not np.array_equal(first[0], again[0])  # exact at first, quantised now


# None, "flash": attend_flash_kivi (attend_flash.comp's KIVI build); "rows": the read-out path — read_rows_kivi, then the rows
# attended (attend_flash on GPUs, attend_direct on CPU drivers: Attention.rows_plan)
@pytest.mark.parametrize("path", [None, "flash", "rows"])
@pytest.mark.parametrize("group", [1, 3])
def test_attention_and_steps_match_the_reference(group, path, make_arena):
    spec = K.KiviSpec()
    hd, n_kv, n_ctx = 64, 2, 400
    rng = np.random.default_rng(group)
    k, v = _rows(rng, n_kv, n_ctx, hd)
    arena = make_arena(1, n_kv, hd, n_ctx, cache="kivi")
    arena.append(0, k[:, :300], v[:, :300])
    q = rng.standard_normal((n_kv * group, hd)).astype(np.float32)
    att = arena.attention(n_kv * group)
    att.path = path
    assert att.rows_plan(300).path == (path if path == "flash" else ("flash" if att.local == 64 else "direct"))
    for n_used in (1, 150, 300):
        kr, vr = K.cache_rows(k, v, 300, spec)
        ref = attention_ref.attend(q, kr, vr, n_used)
        assert nmse(ref, arena.attend(0, q, n_used)) <= 1e-9
    for t in range(300, 303):  # decode steps: append one token, attend over all
        out = arena.step(0, k[:, t:t + 1], v[:, t:t + 1], q)
        kr, vr = K.cache_rows(k, v, t + 1, spec)
        assert nmse(attention_ref.attend(q, kr, vr, t + 1), out) <= 1e-9
        assert np.isfinite(out).all()
    # attend_flash_kivi reads the words in place (tests/gpu/test_vk_attend_kivi.py); the read-out
    # path is Attention.attend_reconstructed's (path "rows"), not a plan's
    assert arena.attention(n_kv * group).plan(0, 10, path="flash").path == "flash"
    with pytest.raises(E.ArenaError, match="attend_reconstructed"):
        arena.attention(n_kv * group).plan(0, 10, path="rows")


def test_bad_input_is_refused_and_changes_nothing(make_arena):
    spec = K.KiviSpec(4, 4, 8)
    rng = np.random.default_rng(2)
    k, v = _rows(rng, 2, 64, 64)
    arena = make_arena(1, 2, 64, 64, cache="kivi", kivi=spec)
    arena.append(0, k[:, :50], v[:, :50])
    before = arena.read(0)
    for bad in ((k[:, :5].astype(np.float64), v[:, :5]), (k[:, :5], v[:, :4]), (k[:1, :5], v[:1, :5]),
                (k[:, :15], v[:, :15])):  # wrong dtype, K/V token counts differ, wrong heads, past n_ctx
        with pytest.raises((E.ShapeError, E.ArenaError)):
            arena.append(0, *bad)
    assert arena.n_tokens(0) == 50
    after = arena.read(0)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    arena.append(0, k[:, 50:64], v[:, 50:64])  # and it goes on from where it was
    np.testing.assert_array_equal(arena.read(0)[0], K.cache_rows(k, v, 64, spec)[0])


def test_a_kivi_arena_needs_what_it_says(make_arena):
    with pytest.raises(E.ArenaError, match="multiple of 32"):
        make_arena(1, 2, 48, 64, cache="kivi")
    with pytest.raises(E.ArenaError, match="kivi settings given"):
        make_arena(1, 2, 64, 64, cache="f16", kivi=K.KiviSpec())
    with pytest.raises(E.ArenaError, match="KiviSpec"):
        make_arena(1, 2, 64, 64, cache="kivi", kivi=(4, 4, 128))


def test_layout_of_a_kivi_cache():
    from kvdict_vk import layout as L
    lay = L.build_layout(2, 3, 64, 256, cache="kivi", guard_words=8)
    ll = lay.layers[1]
    assert ll.k.row_words == 8 and ll.v.row_words == 10  # 4 bits: levels; values add 2 stats words
    assert ll.k.stats_words == 3 * (256 // 32) * 64 and ll.v.stats_words == 0
    assert ll.k.window_tokens == ll.v.window_tokens == 128 + 32
    assert ll.k.state_word == ll.v.state_word
    assert lay.bytes_per_token == 2 * 2 * 3 * 40  # 40 B a head vector at 4 bits, keys' statistics included
    d = lay.to_dict()
    assert d["kivi"] == {"k_bits": 4, "v_bits": 4, "recent": 128, "group": 32}
    assert d["layers"][0]["k"]["row_format"] == "kivi" and d["layers"][0]["k"]["group_stats"]["words"] == 1536
    spans = sorted([(ll.k.region_word, ll.k.region_words), (ll.v.region_word, ll.v.region_words),
                    (ll.k.stats_word, ll.k.stats_words), (ll.k.window_word, 3 * 160 * 32),
                    (ll.v.window_word, 3 * 160 * 32), (ll.k.state_word, 1)])
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b  # no two blocks overlap
    assert spans[-1][0] + spans[-1][1] <= ll.total_words


def test_layout_of_a_batched_kivi_cache():
    """A KIVI layout of 3 sequences of 100 tokens (not whole groups): each (KV head, sequence)
    — its KIVI head g · 3 + s — has ⌈100 / 32⌉ groups of statistics and a ring, each sequence a
    state word; the regions hold the sequences' rows back to back, as every cache's do."""
    from kvdict_vk import layout as L
    one = L.build_layout(1, 2, 64, 300, cache="kivi")
    lay = L.build_layout(1, 2, 64, 300, cache="kivi", seqs=3)
    k, v = lay.layers[0].streams
    assert (k.kivi_seqs, k.seq_ctx, one.layers[0].k.seq_ctx) == (3, 100, 300)
    assert k.region_words == one.layers[0].k.region_words and k.row_words == one.layers[0].k.row_words
    assert k.stats_words == 2 * 3 * 4 * 64 and one.layers[0].k.stats_words == 2 * 10 * 64
    assert k.window_words == v.window_words == 2 * 3 * 160 * 32
    assert [k.kivi_head(g, s) for g in range(2) for s in range(3)] == list(range(6))
    d = lay.to_dict()["layers"][0]["k"]
    assert d["state"]["words"] == 3 and d["seqs"] == 3
    spans = sorted([(k.region_word, k.region_words), (v.region_word, v.region_words), (k.stats_word, k.stats_words),
                    (k.window_word, k.window_words), (v.window_word, v.window_words), (k.state_word, 3)])
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b
    with pytest.raises(E.ArenaError, match="equal length"):
        L.build_layout(1, 2, 64, 301, cache="kivi", seqs=3)
