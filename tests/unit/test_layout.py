"""kvdict_vk.layout and kvdict_vk.rows: arena arithmetic (pure, no GPU), and the push-constant
mirror test (kvdict_vk.vk.abi's blocks against every shader's GLSL)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdict_vk import errors as E
from kvdict_vk import layout as L
from kvdict_vk import rows as R
from kvdict_vk.dictionary import KvDictArtifact, StreamDict, is_f16_exact, round_to_f16
from kvdict_vk.residual import residual_words
from kvdict_vk.vk import abi

SHADERS = Path(__file__).resolve().parents[2] / "shaders"


def _artifact(rng, hd=16, na=8, pairs=((4, None), (None, None), (2, 4)), n_heads=1, bits=None):
    """``bits``: per layer a (K, V) pair of residual bits (default: none)."""
    def sd(s, mean, b):
        return StreamDict(rng.standard_normal((n_heads, na, hd), dtype=np.float32),
                          mean=rng.standard_normal((n_heads, hd), dtype=np.float32) if mean else None,
                          sparsity=s, residual_bits=b,
                          residual_scale=rng.random((n_heads, hd), dtype=np.float32) + 0.5 if b else None)
    bits = bits or tuple((0, 0) for _ in pairs)
    layers = tuple(tuple(None if s is None else sd(s, (i + j) % 2 == 0, bits[i][j]) for j, s in enumerate(p))
                   for i, p in enumerate(pairs))
    return KvDictArtifact(hd, na, max(s for p in pairs for s in p if s), layers)


def _blocks(ll: L.LayerLayout):
    out = []
    for s in ll.streams:
        out.append((s.region_word, s.region_word + s.region_words))
    for s in ll.streams:
        if s.atoms_word is not None:
            out.append((s.atoms_word, s.atoms_word + s.atoms_words))
    for s in ll.streams:
        if s.mean_word is not None:
            out.append((s.mean_word, s.mean_word + s.mean_words))
    for s in ll.streams:
        if s.scale_word is not None:
            out.append((s.scale_word, s.scale_word + s.scale_words))
    return out


def test_f16_layout_is_the_default_cache():
    lay = L.build_layout(2, 3, 64, 100)
    assert lay.mode == "f16" and lay.n_atoms == 0
    for ll in lay.layers:
        k, v = ll.streams
        assert k.half and k.row_format == "f16" and k.row_words == 32 and ll.tail_word is None
        assert v.region_word == 3 * 100 * 32 and k.word(2, 99, 31) == (2 * 100 + 99) * 32 + 31
    assert lay.bytes_per_token == lay.f16_bytes_per_token == lay.f32_bytes_per_token // 2
    with pytest.raises(E.ArenaError, match="even"):
        L.build_layout(1, 1, 7, 4)
    with pytest.raises(E.ArenaError, match="cache"):
        L.build_layout(1, 1, 8, 4, cache="bf16")


def test_q8_0_layout():
    """q8_0 rows: the f16 block scales (two a word) then the int8 values four a word —
    llama.cpp's 34 bytes per block of 32: 68 B a head vector at head_dim 64."""
    lay = L.build_layout(1, 2, 64, 10, cache="q8_0")
    k = lay.layers[0].k
    assert lay.mode == "q8_0" and k.q8 and k.row_format == "q8_0" and k.row_words * 4 == 68
    assert L.row_words(128, 0, 0, "q8_0") * 4 == 136 and L.row_words(32, 0, 0, "q8_0") * 4 == 36
    with pytest.raises(E.ArenaError, match="multiple of 32"):
        L.build_layout(1, 1, 48, 4, cache="q8_0")
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)
    w = R.q8_0_words(x)
    assert w.dtype == np.uint32 and w.shape == (2, 3, 17)
    assert np.abs(R.q8_0_rows(w, 64) - x).max() <= np.abs(x).max() / 127  # half a step, at most


def test_f32_layout_on_request():
    lay = L.build_layout(2, 3, 64, 100, cache="f32")
    assert lay.mode == "f32" and lay.n_atoms == 0
    for ll in lay.layers:
        assert ll.tail_word is None and ll.tail_words == 0
        k, v = ll.streams
        assert not k.coded and k.row_words == 64 and k.atoms_word is None
        assert k.region_word == 0 and k.region_words == 3 * 100 * 64
        assert v.region_word == 3 * 100 * 64 and v.region_word % L.ALIGN_WORDS == 0
        assert ll.total_words == -(-(v.region_word + v.region_words) // L.ALIGN_WORDS) * L.ALIGN_WORDS
        assert k.word(2, 99, 63) == (2 * 100 + 99) * 64 + 63
    assert lay.bytes_per_token == lay.f32_bytes_per_token == 2 * 2 * 3 * 64 * 4


def test_dict_layout_regions_tail_and_word_formula():
    rng = np.random.default_rng(0)
    art = _artifact(rng)
    n_kv, n_ctx, hd, na = 3, 37, 16, 8
    lay = L.build_layout(3, n_kv, hd, n_ctx, art)
    assert lay.mode == "dict" and lay.n_atoms == na and lay.sparsity == 4
    for ll, pair in zip(lay.layers, art.layers):
        for s, d in zip(ll.streams, pair):
            assert s.coded == (d is not None)
            assert s.sparsity == (d.sparsity if d else 0)
            assert s.row_words == (d.sparsity if d else hd)
            assert s.region_words == n_kv * n_ctx * s.row_words
            assert s.region_word % L.ALIGN_WORDS == 0
            assert s.has_mean == (d is not None and d.mean is not None)
            h, t, j = 2, 5, s.row_words - 1
            assert s.word(h, t, j) == s.region_word + (h * n_ctx + t) * s.row_words + j
            with pytest.raises(E.ArenaError):
                s.word(n_kv, 0, 0)
        k, v = ll.streams
        assert ll.tail_word % L.ALIGN_WORDS == 0 and ll.tail_word >= v.region_word + v.region_words
        # packed tail: K atoms, V atoms, K mean, V mean, K scale, V scale
        assert k.atoms_word == ll.tail_word and v.atoms_word == k.atoms_word + na * hd
        assert k.mean_word == v.atoms_word + na * hd and v.mean_word == k.mean_word + hd
        assert k.scale_word == v.mean_word + hd and v.scale_word == k.scale_word + hd
        assert ll.tail_words == 2 * na * hd + 4 * hd
        assert ll.total_words >= ll.tail_word + ll.tail_words and ll.total_words % L.ALIGN_WORDS == 0
    assert lay.bytes_per_token == sum(s.bytes_per_token for ll in lay.layers for s in ll.streams)
    assert lay.total_bytes == sum(ll.total_words for ll in lay.layers) * 4


def test_tail_image_is_the_atoms_flat_block():
    rng = np.random.default_rng(1)
    art = _artifact(rng)
    lay = L.build_layout(3, 2, 16, 5, art)
    flat = art.atoms_flat()
    block = art.n_atoms * art.head_dim
    for ll, pair in zip(lay.layers, art.layers):
        img = R.layer_tail_image(lay, ll.index, flat, tuple(None if d is None else d.mean for d in pair))
        f = img.view(np.float32)
        for j, (s, d) in enumerate(zip(ll.streams, pair)):
            a0 = s.atoms_word - ll.tail_word
            want = flat[(2 * ll.index + j) * block:(2 * ll.index + j + 1) * block]
            assert np.array_equal(f[a0:a0 + block], want)
            if d is None:
                assert not f[a0:a0 + block].any()
            m0 = s.mean_word - ll.tail_word
            mean = d.mean[0] if d is not None and d.mean is not None else np.zeros(16, np.float32)
            assert np.array_equal(f[m0:m0 + 16], mean)
            sc0 = s.scale_word - ll.tail_word
            assert not f[sc0:sc0 + 16].any()  # no residual scales given: zeros
    with pytest.raises(E.ArenaError):
        R.layer_tail_image(L.build_layout(1, 1, 16, 4), 0, None, (None, None))
    with pytest.raises(E.DictMismatchError):
        R.layer_tail_image(lay, 0, flat[:-1], (None, None))


@pytest.mark.parametrize("n_heads", [1, 2])
def test_binary16_atoms_are_the_one_copy(n_heads):
    """Atoms that are all binary16 values: each stream's atoms block holds them once, in
    binary16, chunk-pair order (half the float32 block's words, 4-word aligned), the same
    values; the means and scales follow; the tail is half the float32 atoms smaller."""
    rng = np.random.default_rng(7)
    plain = _artifact(rng, n_heads=n_heads)
    art = plain.with_f16_atoms()
    assert art.atoms_f16_exact and not plain.atoms_f16_exact
    hd, na, g = 16, 8, n_heads
    lay, lay32 = L.build_layout(3, 2, hd, 5, art), L.build_layout(3, 2, hd, 5, plain)
    flat = art.atoms_flat()
    block = g * na * hd
    for ll, ll32, pair in zip(lay.layers, lay32.layers, art.layers):
        k, v = ll.streams
        assert k.atoms_f16 and v.atoms_f16 and not ll32.k.atoms_f16 and not ll32.v.atoms_f16
        assert k.atoms_word % L.VEC4_WORDS == 0 and v.atoms_word % L.VEC4_WORDS == 0
        assert k.atoms_words == v.atoms_words == block // 2 and ll32.k.atoms_words == block
        assert v.atoms_word == k.atoms_word + k.atoms_words and k.mean_word == v.atoms_word + v.atoms_words
        assert ll.tail_words == ll32.tail_words - block
        for s in ll.streams:
            assert s.to_dict()["atoms"] == {"word": s.atoms_word, "words": s.atoms_words,
                                            "byte": 4 * s.atoms_word, "bytes": 4 * s.atoms_words}
            assert s.to_dict()["atoms_format"] == "f16"
        assert ll32.k.to_dict()["atoms_format"] == "f32"
        img = R.layer_tail_image(lay, ll.index, flat, tuple(None if d is None else d.mean for d in pair))
        for j, s in enumerate(ll.streams):
            h0 = s.atoms_word - ll.tail_word
            halves = img[h0:h0 + block // 2].view(np.float16).astype(np.float32).reshape(g * na, hd)
            atoms = flat[(2 * ll.index + j) * block:(2 * ll.index + j + 1) * block].reshape(g * na, hd)
            # chunk-pair order: quad p = elements 4p..4p+3, then hd/2 + 4p..hd/2 + 4p+3
            for p in range(hd // 8):
                assert np.array_equal(halves[:, 8 * p:8 * p + 4], atoms[:, 4 * p:4 * p + 4])
                assert np.array_equal(halves[:, 8 * p + 4:8 * p + 8], atoms[:, hd // 2 + 4 * p:hd // 2 + 4 * p + 4])
        img32 = R.layer_tail_image(lay32, ll.index, plain.atoms_flat(), (None, None))
        atoms32 = plain.atoms_flat()[2 * ll.index * block:(2 * ll.index + 1) * block]
        assert np.array_equal(img32[ll32.k.atoms_word - ll32.tail_word:][:block].view(np.float32), atoms32)
    with pytest.raises(E.DictMismatchError, match="binary16"):  # the layout wants f16 atoms, these are not
        R.layer_tail_image(lay, 0, plain.atoms_flat(), (None, None))
    guarded = L.build_layout(3, 2, hd, 5, art, guard_words=4)
    for ll in guarded.layers:  # guards before and after each f16 block
        for s in ll.streams:
            lo, hi = s.atoms_word, s.atoms_word + s.atoms_words
            assert any(b == lo for _, b in ll.guard_spans) and any(a == hi for a, _ in ll.guard_spans)


def test_with_f16_atoms_rounds_the_atoms_and_nothing_else():
    rng = np.random.default_rng(9)
    art = _artifact(rng, bits=((3, 0), (0, 0), (0, 4)))
    f16 = art.with_f16_atoms()
    assert f16.atoms_f16_exact and not art.atoms_f16_exact
    for pair, pair16 in zip(art.layers, f16.layers):
        for d, d16 in zip(pair, pair16):
            assert (d is None) == (d16 is None)
            if d is None:
                continue
            assert np.array_equal(d16.atoms, round_to_f16(d.atoms))
            assert (d16.sparsity, d16.residual_bits) == (d.sparsity, d.residual_bits)
            for a, b in ((d.mean, d16.mean), (d.residual_scale, d16.residual_scale), (d.metric, d16.metric)):
                assert (a is None and b is None) or np.array_equal(a, b)


def test_binary16_atoms_need_head_dim_a_multiple_of_8_and_finite_halves():
    rng = np.random.default_rng(8)
    for hd in (15, 12, 20):
        odd = _artifact(rng, hd=hd).with_f16_atoms()
        assert odd.atoms_f16_exact
        odd_lay = L.build_layout(3, 2, hd, 5, odd)
        assert all(not s.atoms_f16 and s.atoms_words == 8 * hd for ll in odd_lay.layers for s in ll.streams)
        if hd % 2 == 0:
            with pytest.raises(E.ArenaError, match="head_dim % 8"):
                R.atoms_f16_order(hd)
    assert sorted(R.atoms_f16_order(24)) == list(range(24))  # a permutation of the elements
    big = np.full((4, 8), 70000.0, np.float32)  # beyond binary16's range: left as it is
    assert np.array_equal(round_to_f16(big), big) and not is_f16_exact(big)
    x = np.float32([1 + 2 ** -12, -3.0, 2 ** -30])
    assert np.array_equal(round_to_f16(x), np.float32([1.0, -3.0, 0.0])) and is_f16_exact(round_to_f16(x))


def test_per_head_tail_and_residual_slots():
    """Per-head dictionaries: every tail block holds n_kv heads, in atoms_flat order; a
    residual stage widens the slot to sparsity + ⌈hd·b/32⌉ + 1 words."""
    rng = np.random.default_rng(11)
    n_kv, hd, na, n_ctx = 3, 20, 8, 7
    bits = ((3, 0), (0, 0), (8, 1))
    art = _artifact(rng, hd, na, n_heads=n_kv, bits=bits)
    lay = L.build_layout(3, n_kv, hd, n_ctx, art)
    assert lay.n_dict_heads == n_kv
    flat = art.atoms_flat()
    block = n_kv * na * hd
    assert flat.size == 3 * 2 * block
    for ll, pair, lb in zip(lay.layers, art.layers, bits):
        k, v = ll.streams
        assert v.atoms_word == k.atoms_word + block and k.mean_word == v.atoms_word + block
        assert v.mean_word == k.mean_word + n_kv * hd and k.scale_word == v.mean_word + n_kv * hd
        assert v.scale_word == k.scale_word + n_kv * hd and ll.tail_words == 2 * block + 4 * n_kv * hd
        img = R.layer_tail_image(lay, ll.index, flat, tuple(None if d is None else d.mean for d in pair),
                                 tuple(None if d is None else d.residual_scale for d in pair))
        f = img.view(np.float32)
        for j, (s, d, b) in enumerate(zip(ll.streams, pair, lb)):
            assert s.coded == (d is not None)
            if d is None:
                assert s.row_words == hd and s.slot_words == 0 and s.residual_bits == 0
                continue
            assert s.residual_bits == b and s.level_words == (-(-hd * b // 32) if b else 0)
            assert s.slot_words == s.row_words == d.slot_words == d.sparsity + residual_words(hd, b)
            assert s.head_atoms_stride == na * hd and s.head_vec_stride == hd
            a0 = s.atoms_word - ll.tail_word
            assert np.array_equal(f[a0:a0 + block], d.atoms.reshape(-1))
            for h in range(n_kv):  # head h of the atoms block is the dictionary of KV head h
                start = a0 + h * s.head_atoms_stride
                assert np.array_equal(f[start:start + na * hd], d.head(h).atoms.reshape(-1))
            m0, sc0 = s.mean_word - ll.tail_word, s.scale_word - ll.tail_word
            want_mean = np.zeros((n_kv, hd)) if d.mean is None else d.mean
            assert np.array_equal(f[m0:m0 + n_kv * hd], np.asarray(want_mean, np.float32).reshape(-1))
            want_scale = np.zeros((n_kv, hd)) if d.residual_scale is None else d.residual_scale
            assert np.array_equal(f[sc0:sc0 + n_kv * hd], np.asarray(want_scale, np.float32).reshape(-1))
        assert lay.layers[ll.index].to_dict()["k"]["n_dict_heads"] == n_kv
    # shared dictionaries: strides 0 (every KV head reads head 0)
    shared = L.build_layout(3, n_kv, hd, n_ctx, _artifact(rng, hd, na, bits=bits))
    assert shared.n_dict_heads == 1
    assert shared.layers[0].k.head_atoms_stride == 0 and shared.layers[0].k.head_vec_stride == 0
    bpt = sum(n_kv * 4 * (d.slot_words if d is not None else hd) for p in art.layers for d in p)
    assert lay.bytes_per_token == shared.bytes_per_token == bpt


def test_guard_mode_surrounds_every_block():
    rng = np.random.default_rng(2)
    art = _artifact(rng, hd=12)
    lay = L.build_layout(3, 2, 12, 9, art, guard_words=10)
    assert lay.guard_words == 12  # rounded up to keep vec4 alignment
    for ll in lay.layers:
        blocks = sorted(_blocks(ll))
        assert blocks[0][0] >= 12 and ll.total_words - blocks[-1][1] >= 12
        for (a0, a1), (b0, b1) in zip(blocks, blocks[1:]):
            assert b0 - a1 >= 12
        covered = np.zeros(ll.total_words, int)
        for lo, hi in blocks + list(ll.guard_spans):
            covered[lo:hi] += 1
        assert (covered == 1).all()  # guards are exactly the complement of the blocks
        for s in ll.streams:
            assert s.region_word % L.ALIGN_WORDS == 0
            assert s.atoms_word % 4 == 0 and s.mean_word % 4 == 0


def test_guard_breaches_name_every_overwritten_guard_word():
    lay = L.build_layout(3, 2, 12, 9, _artifact(np.random.default_rng(2), hd=12), guard_words=8)
    words = [np.full(ll.total_words, lay.guard_value, np.uint32) for ll in lay.layers]
    for ll in lay.layers:  # what the blocks hold does not matter, only the guards
        for lo, hi in _blocks(ll):
            words[ll.index][lo:hi] = 0
    assert lay.guard_breaches(words.__getitem__) == []
    lo, hi = lay.layers[2].guard_spans[2]
    words[2][hi - 1] = 0  # the last guard word before a block
    words[2][lo] ^= 1
    assert lay.guard_breaches(words.__getitem__) == [(2, lo, hi, [lo, hi - 1])]


def test_mismatches_and_bad_dims_are_typed():
    rng = np.random.default_rng(3)
    art = _artifact(rng)
    with pytest.raises(E.DictMismatchError):
        L.build_layout(2, 2, 16, 8, art)  # artifact has 3 layers
    with pytest.raises(E.DictMismatchError):
        L.build_layout(3, 2, 32, 8, art)  # head_dim differs
    for dims in [(0, 1, 16, 8), (1, 1, 16, 0), (1, -2, 16, 8), (1, 1, 16.0, 8)]:
        with pytest.raises(E.ArenaError):
            L.build_layout(*dims)
    with pytest.raises(E.ArenaError):
        L.build_layout(1, 1, 16, 8, guard_words=-1)
    spec = L.DictSpec(16, 8, 2, ((L.StreamSpec(True, 3), L.StreamSpec(False)),))
    with pytest.raises(E.DictMismatchError):
        L.build_layout(1, 1, 16, 8, spec)  # a stream's sparsity above the artifact's
    per_head = _artifact(rng, n_heads=3)
    L.build_layout(3, 3, 16, 8, per_head)
    with pytest.raises(E.DictMismatchError, match="KV heads"):
        L.build_layout(3, 2, 16, 8, per_head)  # per-head dictionaries for another head count
    for bad in (L.StreamSpec(True, 2, residual_bits=9), L.StreamSpec(True, 2, n_heads=2),
                L.StreamSpec(True, 2, residual_bits=3, slot_words=2)):
        with pytest.raises(E.DictMismatchError):
            L.build_layout(1, 2, 16, 8, L.DictSpec(16, 8, 2, ((bad, L.StreamSpec(False)),)))
    ok = L.StreamSpec(True, 2, residual_bits=3, slot_words=2 + residual_words(16, 3))
    L.build_layout(1, 2, 16, 8, L.DictSpec(16, 8, 2, ((ok, L.StreamSpec(False)),)))


def test_spec_description_equals_artifact():
    rng = np.random.default_rng(4)
    art = _artifact(rng)
    spec = L.DictSpec.from_artifact(art)
    assert spec.layers[1] == (L.StreamSpec(False), L.StreamSpec(False))
    assert spec.layers[2][0] == L.StreamSpec(True, 2, art.layers[2][0].mean is not None, 0, 1, 2)
    assert L.build_layout(3, 2, 16, 11, spec).to_dict() == L.build_layout(3, 2, 16, 11, art).to_dict()
    art = _artifact(rng, n_heads=2, bits=((4, 0), (0, 0), (1, 8)))
    spec = L.DictSpec.from_artifact(art)
    assert spec.n_heads == 2 and spec.layers[0][0].slot_words == 4 + residual_words(16, 4)
    assert L.build_layout(3, 2, 16, 11, spec).to_dict() == L.build_layout(3, 2, 16, 11, art).to_dict()


def test_to_dict_is_json():
    rng = np.random.default_rng(5)
    d = L.build_layout(3, 2, 16, 11, _artifact(rng), guard_words=8).to_dict()
    back = json.loads(json.dumps(d))
    assert back["mode"] == "dict" and len(back["layers"]) == 3
    assert back["layers"][0]["k"]["region"]["byte"] == 4 * back["layers"][0]["k"]["region"]["word"]
    assert back["bytes_per_token"] == 4 * 2 * (4 + 16 + 16 + 16 + 2 + 4)


@settings(max_examples=60, deadline=None)
@given(n_layers=st.integers(1, 3), n_kv=st.integers(1, 4), hd=st.integers(1, 70), n_ctx=st.integers(1, 50),
       na=st.integers(1, 40), guard=st.sampled_from([0, 4, 13]), per_head=st.booleans(), data=st.data())
def test_layout_invariants(n_layers, n_kv, hd, n_ctx, na, guard, per_head, data):
    s_max = min(hd, na)
    pairs = tuple(tuple(data.draw(st.one_of(st.none(), st.tuples(st.integers(1, s_max), st.integers(0, 8))))
                        for _ in "kv") for _ in range(n_layers))
    ss = [p[0] for pair in pairs for p in pair if p]
    g = n_kv if per_head else 1
    spec = None if not ss else L.DictSpec(hd, na, max(ss), tuple(
        tuple(L.StreamSpec(False) if p is None else L.StreamSpec(True, p[0], residual_bits=p[1], n_heads=g)
              for p in pair) for pair in pairs), g)
    half = spec is None and hd % 2 == 0  # the uncoded cache is f16 where it can be
    lay = L.build_layout(n_layers, n_kv, hd, n_ctx, spec, guard_words=guard, cache="f16" if half else "f32")
    for ll, pair in zip(lay.layers, pairs):
        for st_, p in zip(ll.streams, pair):
            assert st_.row_words == ((hd // 2 if half else hd) if p is None else p[0] + residual_words(hd, p[1]))
            if ll.tail_word is not None:
                assert st_.atoms_words == g * na * hd and st_.mean_words == st_.scale_words == g * hd
    for ll in lay.layers:
        blocks = sorted(_blocks(ll))
        assert blocks[-1][1] <= ll.total_words
        for (a0, a1), (b0, b1) in zip(blocks, blocks[1:]):
            assert a1 <= b0  # no overlap
        assert all(s.region_word % L.ALIGN_WORDS == 0 for s in ll.streams)
        if ll.tail_word is not None:
            assert ll.tail_word % L.ALIGN_WORDS == 0
        last = ll.streams[1].word(n_kv - 1, n_ctx - 1, ll.streams[1].row_words - 1)
        assert last == ll.streams[1].region_word + ll.streams[1].region_words - 1


# --- push constants ------------------------------------------------------------------------------

def test_push_block_pack_unpack():
    blk = abi.PushBlock("T", (("a", "uint"), ("x", "float"), ("b", "uint")))
    w = blk.pack(a=7, x=-1.5, b=2 ** 32 - 1)
    assert w.dtype == np.uint32 and w.tolist() == [7, np.float32(-1.5).view(np.uint32), 2 ** 32 - 1]
    assert blk.unpack(w) == {"a": 7, "x": -1.5, "b": 2 ** 32 - 1}
    assert blk.size_bytes == 12
    for bad in [dict(a=1, x=0.0), dict(a=1, x=0.0, b=2, c=3), dict(a=-1, x=0.0, b=0),
                dict(a=2 ** 32, x=0.0, b=0), dict(a=1.5, x=0.0, b=0), dict(a=True, x=0.0, b=0)]:
        with pytest.raises(E.DispatchError):
            blk.pack(**bad)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_PUSH = re.compile(r"layout\s*\(\s*push_constant\s*\)\s*uniform\s+(\w+)\s*\{(.*?)\}\s*(\w*)\s*;", re.S)


def _expand(path: Path) -> str:
    return _INCLUDE.sub(lambda m: _expand(path.parent / m.group(1)), path.read_text())


def _glsl_push_block(source: str):
    source = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", source, flags=re.S))
    blocks = _PUSH.findall(source)
    assert len(blocks) == 1, f"expected one push_constant block, found {len(blocks)}"
    name, body, _ = blocks[0]
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        typ, *names = re.split(r"[\s,]+", decl)
        fields += [(n, typ) for n in names if n]
    return name, tuple(fields)


_GLSL_SIZES = {"uint": 4, "float": 4}


def test_every_shader_declares_the_abi_push_block():
    comps = sorted(p.name for p in SHADERS.glob("*.comp"))
    assert comps == sorted(abi.SHADER_PUSH_BLOCKS), "shaders/ and abi.SHADER_PUSH_BLOCKS disagree"
    for comp in comps:
        name, fields = _glsl_push_block(_expand(SHADERS / comp))
        blk = abi.SHADER_PUSH_BLOCKS[comp]
        assert name == blk.name, comp
        assert fields == blk.fields, f"{comp}: GLSL {fields} vs abi {blk.fields}"
        assert all(t in _GLSL_SIZES for _, t in fields), f"{comp}: only 32-bit uint/float members"
        assert sum(_GLSL_SIZES[t] for _, t in fields) == blk.size_bytes
        assert blk.size_bytes <= 128  # the minimum maxPushConstantsSize
    assert set(abi.PUSH_BLOCKS) == {b.name for b in abi.SHADER_PUSH_BLOCKS.values()}
    # every variant of a source declares its source's block
    assert all(v.push is abi.SHADER_PUSH_BLOCKS[v.source] for v in abi.DECLARATIONS.values())


def test_mirror_parser_catches_drift():
    src = "layout(push_constant) uniform CopyPush { uint src_word; uint n_words; uint dst_word; } pc;"
    name, fields = _glsl_push_block(src)
    assert name == "CopyPush" and fields != abi.COPY_PUSH.fields  # order matters
