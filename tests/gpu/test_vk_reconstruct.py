"""GPU reconstruction equals codec.decode (float64), over a grid of shapes and formats.

Slots go in with append_codes, so the GPU is compared with the reference on the very same
words (including out-of-range atom indices and random padding bits in the residual
stage); every arena here is guarded (conftest.make_arena verifies the sentinels after
each test).
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import stream_entry, check_guards, random_artifact, stable_seed
from kvdict_vk import codec
from kvdict_vk.metrics import nmse
from kvdict_vk.synthetic import random_codes, random_slots
from kvdict_vk.vk.read import mapping as M

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 48, 64, 128, 256, 36, 50)  # 36, 50: not multiples of 4 → scalar shaders
N_ATOMS = (16, 1024, 4096, 65536)
SPARSITIES = (1, 4, 8, 16, 32)
RESIDUAL_BITS = (0, 1, 2, 3, 4, 8)

# (head_dim, n_atoms, n_kv, n_ctx, per-head dictionaries, per layer (K, V)) with a stream
# given as None (passthrough), s, or (s, residual bits). Hand-picked so every value of the
# grid appears — both dictionary sharings, every residual width, mixed passthrough
# layers/streams, per-stream sparsity, s = 1, n_ctx = 8192 — plus seeded random draws.
CASES = [
    (32, 16, 2, 64, False, ((1, 1),)),
    (48, 1024, 3, 300, True, (((4, 3), None),)),
    (64, 4096, 2, 8192, False, (((8, 4), (8, 3)),)),
    (128, 65536, 1, 96, False, (((16, 8), None),)),
    (256, 1024, 2, 200, True, (((32, 2), 32),)),
    (36, 16, 3, 100, True, ((None, (4, 1)),)),
    (50, 4096, 2, 64, False, (((8, 3), 1), (None, None))),
    (64, 65536, 2, 256, False, ((32, (16, 4)),)),
    (32, 1024, 3, 128, True, ((8, (32, 8)), (None, None), ((1, 2), None))),
    (128, 16, 3, 2048, True, (((16, 4), 4),)),
    (64, 1024, 3, 1024, True, (((8, 4), (8, 3)),)),  # SmolLM2's shape, the likely default format
]


def _random_cases(n: int, seed: int = 20240601):
    rnd = random.Random(seed)
    out = []
    while len(out) < n:
        hd, na, n_kv, per_head = rnd.choice(HEAD_DIMS), rnd.choice(N_ATOMS), rnd.randint(1, 4), rnd.random() < 0.5
        if na * hd * (n_kv if per_head else 1) > 65536 * 64:  # tail (2 × atoms) ≤ 32 MiB: time, memory
            continue

        def pick():
            s = rnd.choice([s for s in SPARSITIES if s <= min(hd, na)] + [None])
            return s if s is None else (s, rnd.choice(RESIDUAL_BITS))
        layers = tuple((pick(), pick()) for _ in range(rnd.randint(1, 2)))
        if all(s is None for p in layers for s in p):
            continue
        out.append((hd, na, n_kv, rnd.choice([16, 333, 1024]), per_head, layers))
    return out


def _fill(arena, art, rng, n_tokens: int, *, out_of_range: float = 0.01):
    """Append n_tokens of random slots / rows to every layer (two appends); returns them."""
    lay = arena.layout
    stored = []
    for ll, pair in zip(lay.layers, art.layers):
        words = []
        for st, d in zip(ll.streams, pair):
            shape = (lay.n_kv_heads, n_tokens)
            if st.coded:
                words.append(random_slots(rng, d, shape, out_of_range=out_of_range))
                assert words[-1].shape[-1] == st.slot_words == d.slot_words
            else:
                words.append(rng.standard_normal(shape + (lay.head_dim,), dtype=np.float32))
        cut = n_tokens // 3
        arena.append_codes(ll.index, words[0][:, :cut], words[1][:, :cut])
        arena.append_codes(ll.index, words[0][:, cut:], words[1][:, cut:])
        stored.append(words)
    return stored


def _check_read(arena, art, stored, layer, t0, t1):
    k, v = arena.read(layer, t0, t1)
    for out, words, d in zip((k, v), stored[layer], art.layers[layer]):
        assert out.dtype == np.float32 and out.shape == (arena.layout.n_kv_heads, t1 - t0, arena.layout.head_dim)
        if d is None:
            assert np.array_equal(out.view(np.uint32), words[:, t0:t1].view(np.uint32))
        else:
            ref = codec.decode_heads(words[:, t0:t1], d, np.float64)
            err = nmse(ref, out)  # infinite unless the NaN/±Inf positions agree
            assert err <= 1e-12, f"layer {layer} [{t0}, {t1}): NMSE {err:.3g}"


def _case_id(c):
    return f"hd{c[0]}-na{c[1]}-kv{c[2]}-ctx{c[3]}-{'perhead' if c[4] else 'shared'}-{c[5]}"


# CPU-driver and GPU invocation mappings; on the GPU one, both ways of loading the slots
# (mapping.RECONSTRUCT_GPU_MAPPINGS / _F16 pick per sparsity; these force one for every stream)
MAPPINGS = ["row", "chunk-pipelined", "chunk-plain"]


def _force_mapping(monkeypatch, table, table_f16=None):
    """The GPU mapping tables for float32 atoms and for binary16 ones (default: the same)."""
    monkeypatch.setattr(M, "RECONSTRUCT_GPU_MAPPINGS", table)
    monkeypatch.setattr(M, "RECONSTRUCT_GPU_MAPPINGS_F16", table if table_f16 is None else table_f16)


@pytest.mark.parametrize("atoms", ["f32", "f16"])
@pytest.mark.parametrize("mapping", MAPPINGS)
@pytest.mark.parametrize("case", CASES + _random_cases(4), ids=_case_id)
def test_gpu_reconstruct_equals_reference(case, mapping, atoms, make_arena, activate, monkeypatch):
    """atoms "f16": binary16 values, as the forge makes them — the arena keeps them in
    binary16 (head_dim % 8 == 0: half the words) and reconstruct gathers them so; "f32": any
    float32 atoms."""
    hd, na, n_kv, n_ctx, per_head, layers = case
    rng = np.random.default_rng(stable_seed(case))
    art = random_artifact(rng, hd, na, layers, n_heads=n_kv if per_head else 1, f16_atoms=atoms == "f16")
    activate(art)
    if mapping != "row":  # every sparsity: two chunks a row (one where that does not divide it)
        _force_mapping(monkeypatch, ((None, (2, mapping == "chunk-pipelined")),))
    arena = make_arena(len(layers), n_kv, hd, n_ctx, guard_words=4 * hd, shader_mapping=mapping.split("-")[0])
    assert arena.mode == "dict" and arena.layout.n_dict_heads == art.n_heads
    assert all(st.atoms_f16 == (atoms == "f16" and hd % 8 == 0)
               for ll in arena.layout.layers for st in ll.streams)
    row_chunks = hd // 4 if hd % 4 == 0 else hd
    for s in SPARSITIES:
        chunks, pipelined = M.reconstruct_mapping(arena.memory, s)
        assert row_chunks % chunks == 0  # the shader's invocations tile a row
        assert pipelined == (mapping == "chunk-pipelined")
    stored = _fill(arena, art, rng, n_ctx)
    for layer in range(len(layers)):
        _check_read(arena, art, stored, layer, 0, n_ctx)  # everything
        _check_read(arena, art, stored, layer, n_ctx // 3, n_ctx - n_ctx // 5)  # a middle range
        t = int(rng.integers(0, n_ctx))
        _check_read(arena, art, stored, layer, t, t + 1)  # one token


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("cap", [3, 6])
@pytest.mark.parametrize("hd", [64, 12])
def test_narrow_grids_walk_rows_across_heads(hd, cap, pipelined, make_arena, activate, monkeypatch):
    """The GPU mapping with 3 or 6 workgroups: each invocation walks many rows, stepping from
    one KV head's tokens into the next's part way, over whole and partial token ranges; hd 12
    has 3 chunks a row (one chunk an invocation, a grid stride of 64·cap / 3 rows)."""
    from kvdict_vk.vk import kernels
    rng = np.random.default_rng(7 + hd + cap)
    art = random_artifact(rng, hd, 256, (((4, 3), (2, 4)),), n_heads=3)
    activate(art)
    monkeypatch.setattr(kernels, "MAX_WORKGROUPS", cap)
    _force_mapping(monkeypatch, ((None, (2, pipelined)),))
    n_ctx = 150
    arena = make_arena(1, 3, hd, n_ctx, guard_words=4 * hd, shader_mapping="chunk")
    stored = _fill(arena, art, rng, n_ctx)
    for t0, t1 in ((0, n_ctx), (7, 140), (149, 150), (0, 9)):
        _check_read(arena, art, stored, 0, t0, t1)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("hd", [8, 16, 64, 128])
def test_binary16_atoms_under_every_chunking(hd, pipelined, make_arena, activate, monkeypatch):
    """Binary16 atoms gathered a quad (8 halves: chunks c and c + hd/8) at a time, under
    every number of chunks an invocation may write: even counts take both chunks of each quad
    (QUAD_PAIRS), one chunk takes its half of it, a whole row (the row mapping's path) each
    chunk's half in turn — per-head and shared dictionaries, out-of-range words, guards."""
    row_chunks = hd // 4
    for per_head in (True, False):
        rng = np.random.default_rng(hd + 2 * pipelined + per_head)
        art = random_artifact(rng, hd, 64, (((4, 4), (3, 3)),), n_heads=3 if per_head else 1, f16_atoms=True)
        activate(art)
        for chunks in (c for c in (1, 2, 4, 8, 16, 32) if row_chunks % c == 0):
            _force_mapping(monkeypatch, ((None, (chunks, pipelined)),))
            arena = make_arena(1, 3, hd, 77, guard_words=4 * hd, shader_mapping="chunk")
            assert all(st.atoms_f16 for st in arena.layout.layers[0].streams)
            assert M.reconstruct_mapping(arena.memory, 4, atoms_f16=True) == (chunks, pipelined)
            stored = _fill(arena, art, rng, 77)
            for t0, t1 in ((0, 77), (30, 31), (5, 60)):
                _check_read(arena, art, stored, 0, t0, t1)
            check_guards(arena)
            arena.free()


def test_the_grid_is_covered():
    """Every value of the brief's grid appears in the hand-picked cases."""
    seen = {"hd": set(), "na": set(), "s": set(), "bits": set(), "heads": set()}
    for hd, na, n_kv, n_ctx, per_head, layers in CASES:
        seen["hd"].add(hd)
        seen["na"].add(na)
        seen["heads"].add("per-head" if per_head and n_kv > 1 else "shared")
        for e in (e for p in layers for e in p if e is not None):
            s, bits = stream_entry(e)
            seen["s"].add(s)
            seen["bits"].add(bits)
    assert seen == {"hd": set(HEAD_DIMS), "na": set(N_ATOMS), "s": set(SPARSITIES),
                    "bits": set(RESIDUAL_BITS), "heads": {"per-head", "shared"}}
    assert max(c[3] for c in CASES) == 8192
    assert any(all(e is None for e in p) for c in CASES for p in c[5])  # a passthrough layer
    assert any(None in p and any(e is not None for e in p) for c in CASES for p in c[5])  # mixed


def test_gpu_mapping_follows_its_table(make_arena, monkeypatch):
    """reconstruct_mapping: the first table entry whose bound covers the sparsity; chunks that
    do not divide a row fall back to one; CPU drivers' row mapping writes whole rows."""
    _force_mapping(monkeypatch, ((2, (4, True)), (5, (8, False)), (None, (2, True))), ((3, (1, False)), (None, (4, True))))
    gpu = make_arena(1, 2, 64, 8, shader_mapping="chunk")  # 16 chunks a row
    assert [M.reconstruct_mapping(gpu.memory, s) for s in (1, 2, 3, 5, 6, 32)] == \
        [(4, True), (4, True), (8, False), (8, False), (2, True), (2, True)]
    # binary16 atoms' own table
    assert [M.reconstruct_mapping(gpu.memory, s, atoms_f16=True) for s in (1, 3, 4, 32)] == [(1, False), (1, False), (4, True), (4, True)]
    narrow = make_arena(1, 2, 12, 8, shader_mapping="chunk")  # 3 chunks a row: none of 4, 8, 2 divides it
    assert [M.reconstruct_mapping(narrow.memory, s) for s in (1, 3, 6)] == [(1, True), (1, False), (1, True)]
    cpu = make_arena(1, 2, 64, 8, shader_mapping="row")
    assert M.reconstruct_mapping(cpu.memory, 1) == M.reconstruct_mapping(cpu.memory, 32) == (16, False)


@pytest.mark.parametrize("mapping", ["row", "chunk"])
@pytest.mark.parametrize("per_head", [False, True])
def test_out_of_range_words_contribute_zero_and_read_nothing_outside(mapping, per_head, make_arena, activate):
    """Atom index ≥ n_atoms → exactly zero contribution, whatever the coefficient; the
    sentinel after each atoms block is a NaN (and huge if read as a coefficient), so any
    read past the atoms would poison the output — and with per-head dictionaries a read
    past one head's atoms would pick up the next head's and break the comparison."""
    rng = np.random.default_rng(7)
    hd, na, n_kv = 64, 16, 2
    art = random_artifact(rng, hd, na, [((4, 3), 4)], n_heads=n_kv if per_head else 1)
    activate(art)
    # ≥ 8 atoms' worth of NaN after each block
    arena = make_arena(1, n_kv, hd, 8, guard_words=8 * hd, shader_mapping=mapping)
    f16 = lambda x: np.array(x, np.float16).view(np.uint16).astype(np.uint32) << 16
    slots = []
    for d in art.layers[0]:
        bad = random_slots(rng, d, (n_kv, 8))
        edge = np.arange(na, na + 8, dtype=np.uint32)  # the atoms that would sit past the block
        bad[:, :, 1] = (bad[:, :, 1] & 0xFFFF0000) | edge[None, :]
        bad[:, 0, 2] = f16(np.nan) | 0xFFFF  # NaN coefficient, index 65535
        bad[:, 1, 2] = f16(np.inf) | na
        bad[:, 2, 3] = f16(65504.0) | (na + 1)
        slots.append(bad)
    arena.append_codes(0, *slots)
    for out, d, bad in zip(arena.read(0), art.layers[0], slots):
        assert np.isfinite(out).all()
        ref = codec.decode_heads(bad, d)
        assert nmse(ref, out) <= 1e-12
        # the same by hand: in-range code words only
        idx, coef = codec.unpack_codes(bad[..., :d.sparsity])
        keep = bad.copy()
        keep[..., :d.sparsity] = np.where(idx < na, bad[..., :d.sparsity], 0)
        assert nmse(codec.decode_heads(keep, d), out) <= 1e-12


def test_nan_and_inf_propagate_like_the_reference(make_arena, activate):
    """Non-finite coefficients and residual steps give NaN/±Inf exactly where the
    reference does (nmse is infinite unless the positions agree)."""
    rng = np.random.default_rng(8)
    hd, na = 32, 64
    art = random_artifact(rng, hd, na, [((8, 3), 2)], means=False)
    activate(art)
    arena = make_arena(1, 1, hd, 16)
    f16 = lambda x: np.array(x, np.float16).view(np.uint16).astype(np.uint32) << 16
    f32 = lambda x: np.array(x, np.float32).view(np.uint32)
    kd, vd = art.layers[0]
    kc = random_slots(rng, kd, (1, 16))
    kc[0, 3, 0] = f16(np.inf) | 5
    kc[0, 4, 1] = f16(-np.inf) | 7
    kc[0, 5, 2] = f16(np.nan) | 1
    kc[0, 6, 0], kc[0, 6, 1] = f16(np.inf) | 2, f16(-np.inf) | 3  # inf − inf → NaN
    kc[0, 7, -1] = f32(np.nan)  # residual step
    kc[0, 8, -1] = f32(np.inf)
    kc[0, 9, -1] = f32(-np.inf)
    vc = random_slots(rng, vd, (1, 16))
    arena.append_codes(0, kc, vc)
    k, v = arena.read(0)
    ref = codec.decode_heads(kc, kd)
    assert not np.isfinite(ref[0, 3:10]).any(axis=1).all() or not np.isfinite(ref[0, 3:10]).all()
    assert nmse(ref, k) <= 1e-12
    assert nmse(codec.decode_heads(vc, vd), v) <= 1e-12


def test_residual_levels_straddling_words_decode_exactly(make_arena, activate):
    """Every residual width with hand-set levels: element e = level (e·7 + 3) mod 2^b, so
    levels that straddle two words are exercised for b ∤ 32."""
    rng = np.random.default_rng(9)
    hd = 50
    for bits in (1, 3, 5, 6, 7, 8):
        art = random_artifact(rng, hd, 32, [((2, bits), (2, bits))])
        activate(art)
        arena = make_arena(1, 1, hd, 4)
        levels = (np.arange(hd) * 7 + 3) % (1 << bits)
        words = []
        for d in art.layers[0]:
            codes = random_codes(rng, (4, 2), 32)
            from kvdict_vk.residual import pack_levels
            packed = np.repeat(pack_levels(levels[None], bits), 4, axis=0)
            step = np.full((4, 1), 0.25, np.float32).view(np.uint32)
            words.append(np.concatenate([codes, packed, step], axis=1)[None])
        arena.append_codes(0, *words)
        for out, d, w in zip(arena.read(0), art.layers[0], words):
            assert nmse(codec.decode_heads(w, d), out) <= 1e-12, bits
        arena.free()
