"""KvArena: both modes, the write path, chunking, typed errors, lifetime, size refusal."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_guards, random_artifact
from kvdict_vk import codec, runtime
from kvdict_vk import errors as E
from kvdict_vk.metrics import nmse
from kvdict_vk.synthetic import random_slots

pytestmark = pytest.mark.gpu


def _rows(rng, n_kv, t, hd):
    return rng.standard_normal((n_kv, t, hd), dtype=np.float32)


@pytest.mark.parametrize("mapping", ["row", "chunk"])
def test_f32_mode_returns_exactly_what_was_appended(mapping, make_arena):
    rng = np.random.default_rng(0)
    arena = make_arena(2, 3, 64, 40, shader_mapping=mapping, cache="f32")
    assert arena.mode == "f32" and arena.layout.layers[0].tail_word is None
    k, v = _rows(rng, 3, 40, 64), _rows(rng, 3, 40, 64)
    k[0, 0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    k[1, 2, 0] = np.array([0x7FC01234], np.uint32).view(np.float32)[0]  # a NaN payload
    for a, b in ((0, 1), (1, 17), (17, 40)):
        assert arena.append(1, k[:, a:b], v[:, a:b]) == b
    assert arena.n_tokens(1) == 40 and arena.n_tokens(0) == 0
    kk, vv = arena.read(1)
    assert np.array_equal(kk.view(np.uint32), k.view(np.uint32))  # bit-exact, NaN payloads too
    assert np.array_equal(vv.view(np.uint32), v.view(np.uint32))
    kk, vv = arena.read(1, 39, 40)
    assert np.array_equal(kk, k[:, 39:40]) and np.array_equal(vv, v[:, 39:40])
    e = arena.read(1, 5, 5)
    assert e[0].shape == (3, 0, 64)


@pytest.mark.parametrize("mapping", ["row", "chunk"])
def test_f32_mode_scalar_head_dim(mapping, make_arena):
    rng = np.random.default_rng(1)
    arena = make_arena(1, 2, 18, 9, shader_mapping=mapping, cache="f32")  # 18 % 4 ≠ 0 → scalar shaders
    k, v = _rows(rng, 2, 9, 18), _rows(rng, 2, 9, 18)
    arena.append(0, k, v)
    kk, vv = arena.read(0, 2, 9)
    assert np.array_equal(kk, k[:, 2:]) and np.array_equal(vv, v[:, 2:])


@pytest.mark.parametrize("hd", [8, 18, 64])
def test_f16_mode_reads_the_halves_of_what_was_appended(hd, make_arena, monkeypatch):
    """The default uncoded cache stores f16 (two halves a word): a read returns exactly
    numpy's float16 rounding of the appended rows, widened back — NaN and ±Inf included,
    overflow to ±Inf as numpy does — and the layer holds head_dim/2 words a row."""
    monkeypatch.delenv("KVDICT_VK_CACHE", raising=False)
    rng = np.random.default_rng(21)
    arena = make_arena(2, 3, hd, 20)
    assert arena.mode == "f16" and arena.layout.layers[0].k.row_words == hd // 2
    k = (rng.standard_normal((3, 20, hd)) * 30).astype(np.float32)
    v = rng.standard_normal((3, 20, hd)).astype(np.float32)
    k[0, 0, :4] = [np.nan, np.inf, -np.inf, 1e6]  # 1e6 overflows f16 → inf
    arena.append(1, k[:, :13], v[:, :13])
    arena.append_codes(1, k[:, 13:], v[:, 13:])  # rows given as f32 are stored as f16 too
    kk, vv = arena.read(1, 0, 20)
    want_k, want_v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    assert np.array_equal(np.isnan(kk), np.isnan(want_k))
    assert np.array_equal(np.nan_to_num(kk), np.nan_to_num(want_k)) and np.array_equal(vv, want_v)
    assert np.isinf(kk[0, 0, 3]) and not np.array_equal(kk, k)  # really rounded, not f32
    monkeypatch.setenv("KVDICT_VK_CACHE", "f32")
    assert make_arena(1, 1, 8, 4).mode == "f32"
    monkeypatch.setenv("KVDICT_VK_CACHE", "bf16")
    with pytest.raises(E.ArenaError, match="cache"):
        make_arena(1, 1, 8, 4)


@pytest.mark.parametrize("hd", [32, 64, 96])
def test_q8_0_mode_reads_llama_cpp_q8_0(hd, make_arena):
    """cache="q8_0": a read returns exactly what llama.cpp's q8_0 round trip gives (the
    forge's independent twin, kvdict_vk.forge.quant.q8_0), all-zero blocks included."""
    from kvdict_vk.forge import quant
    rng = np.random.default_rng(22)
    arena = make_arena(1, 2, hd, 30, cache="q8_0")
    assert arena.mode == "q8_0"
    k = (rng.standard_normal((2, 30, hd)) * 7).astype(np.float32)
    v = rng.standard_normal((2, 30, hd)).astype(np.float32)
    k[1, 3, :32] = 0
    arena.append(0, k[:, :20], v[:, :20])
    arena.append_codes(0, k[:, 20:], v[:, 20:])
    kk, vv = arena.read(0)
    assert np.array_equal(kk, quant.q8_0(k)) and np.array_equal(vv, quant.q8_0(v))
    assert not np.array_equal(kk, k)


def test_f16_mode_needs_an_even_head_dim(make_arena):
    with pytest.raises(E.ArenaError, match="even head_dim"):
        make_arena(1, 1, 7, 4, cache="f16")


def _reconstruct_on_write(layer, k_not_v, rows, n_tokens):
    """runtime.reconstruct_kv on (n_kv, T, hd) rows: the [token][head][dim] projection
    buffer an engine would hand it, n_tokens at a time; back as (n_kv, T, hd)."""
    n_kv, t, hd = rows.shape
    out, did = np.empty_like(rows), []
    for t0 in range(0, t, n_tokens):
        proj = np.ascontiguousarray(rows[:, t0:t0 + n_tokens].transpose(1, 0, 2))
        did.append(runtime.reconstruct_kv(layer, k_not_v, proj, n_kv, n_tokens=proj.shape[0]))
        out[:, t0:t0 + n_tokens] = proj.transpose(1, 0, 2)
    assert len(set(did)) == 1
    return out, did[0]


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("bits", [(0, 0), (4, 3)], ids=["no-residual", "residual-4-3"])
def test_store_code_then_reconstruct_on_read_equals_reconstruct_on_write(per_head, bits, make_arena, activate):
    """The arena's decode path (append → encode_heads on the CPU → slots on the GPU →
    reconstruct on read) equals runtime.reconstruct_kv on the same rows: token by token,
    and for a batch (encoded as one batch by both)."""
    rng = np.random.default_rng(2)
    n_kv, hd, n_tok = 3, 64, 12
    kb, vb = bits
    art = random_artifact(rng, hd, 256, [((8, kb), (4, vb)), (None, (8, vb)), (None, None)],
                          n_heads=n_kv if per_head else 1)
    activate(art)
    arena = make_arena(3, n_kv, hd, 32)
    for layer in range(3):
        k, v = _rows(rng, n_kv, n_tok, hd), _rows(rng, n_kv, n_tok, hd)
        for t in range(n_tok):
            arena.append(layer, k[:, t:t + 1], v[:, t:t + 1])
        batch = _rows(rng, n_kv, 9, hd), _rows(rng, n_kv, 9, hd)
        arena.append(layer, *batch)
        got = arena.read(layer)
        for j, (rows, brows, out) in enumerate(zip((k, v), batch, got)):
            want, did = _reconstruct_on_write(layer, j == 0, rows, 1)
            bwant, _ = _reconstruct_on_write(layer, j == 0, brows, brows.shape[1])
            assert did == (art.layers[layer][j] is not None)
            if not did:
                assert np.array_equal(out, np.concatenate([rows, brows], 1))
            else:
                assert nmse(want, out[:, :n_tok]) <= 1e-12
                assert nmse(bwant, out[:, n_tok:]) <= 1e-12


def test_chunked_appends_and_reads(make_arena, activate, monkeypatch):
    from kvdict_vk.vk.arena import config
    monkeypatch.setattr(config, "UPLOAD_CAP_WORDS", 300)
    monkeypatch.setattr(config, "OUT_CAP_WORDS", 1000)
    monkeypatch.setattr(config, "OUT_MIN_WORDS", 64)
    rng = np.random.default_rng(3)
    art = random_artifact(rng, 16, 32, [((4, 5), None)], n_heads=2)
    activate(art)
    arena = make_arena(1, 2, 16, 200)
    assert arena.memory.read_words < 2 * 2 * 16 * 200  # reads really are split
    d = art.layers[0][0]
    kc = random_slots(rng, d, (2, 200))
    v = _rows(rng, 2, 200, 16)
    arena.append_codes(0, kc, v)  # more than one upload buffer's worth
    k_out, v_out = arena.read(0, 3, 197)
    assert np.array_equal(v_out, v[:, 3:197])
    assert nmse(codec.decode_heads(kc[:, 3:197], d), k_out) <= 1e-12
    with pytest.raises(E.ArenaError, match="read-back buffer"):
        arena.read_plan(0, 0, 200)


def test_read_plan_reruns(make_arena):
    rng = np.random.default_rng(4)
    arena = make_arena(1, 1, 8, 16, cache="f32")
    k, v = _rows(rng, 1, 16, 8), _rows(rng, 1, 16, 8)
    arena.append(0, k, v)
    plan = arena.read_plan(0, 4, 12)
    for _ in range(2):
        plan.dispatch()
        kk, vv = plan.readback()
        assert np.array_equal(kk, k[:, 4:12]) and np.array_equal(vv, v[:, 4:12])
    assert np.array_equal(plan.run()[1], v[:, 4:12])


def test_typed_argument_errors(make_arena):
    rng = np.random.default_rng(5)
    arena = make_arena(2, 2, 8, 10)
    good = _rows(rng, 2, 3, 8)
    bad_rows = [good.astype(np.float64), good[:1], good[:, :, :4], good[0], good.tolist(),
                good.astype(np.float16)]
    for bad in bad_rows:
        with pytest.raises(E.ShapeError):
            arena.append(0, bad, good)
        with pytest.raises(E.ShapeError):
            arena.append(0, good, bad)
    with pytest.raises(E.ShapeError):
        arena.append(0, good, good[:, :2])  # K and V token counts differ
    with pytest.raises(E.ShapeError):
        arena.append_codes(0, good.view(np.uint32), good)  # f32 arena: rows, not code words
    for layer in (-1, 2, True, 1.0, "0"):
        with pytest.raises(E.LayerIndexError):
            arena.append(layer, good, good)
        with pytest.raises(E.LayerIndexError):
            arena.read(layer)
        with pytest.raises(E.LayerIndexError):
            arena.n_tokens(layer)
    arena.append(0, good, good)
    with pytest.raises(E.ArenaError, match="exceed n_ctx"):
        arena.append(0, _rows(rng, 2, 8, 8), _rows(rng, 2, 8, 8))
    assert arena.n_tokens(0) == 3  # a refused append changes nothing
    for t0, t1, match in ((0, 11, "n_ctx"), (0, 4, "appended"), (2, 1, "inverted"), (-1, 2, "negative"),
                          (0.0, 2, "integer")):
        with pytest.raises(E.ArenaError, match=match):
            arena.read(0, t0, t1)


def test_free_is_idempotent_and_final(vk_device):
    from kvdict_vk.vk import KvArena
    arena = KvArena(1, 1, 8, 4, device=vk_device)
    arena.append(0, np.ones((1, 2, 8), np.float32), np.ones((1, 2, 8), np.float32))
    arena.read(0)
    arena.free()
    arena.free()  # harmless
    assert arena.closed
    for call in (lambda: arena.read(0), lambda: arena.n_tokens(0), lambda: arena.layer_words(0),
                 lambda: arena.append(0, np.ones((1, 1, 8), np.float32), np.ones((1, 1, 8), np.float32)),
                 lambda: arena.__enter__()):
        with pytest.raises(E.ArenaError, match="freed"):
            call()
    with KvArena(1, 1, 8, 4, device=vk_device) as a2:
        plan = (a2.append(0, np.ones((1, 1, 8), np.float32), np.ones((1, 1, 8), np.float32)),
                a2.read_plan(0))[1]
    assert a2.closed
    with pytest.raises(E.ArenaError, match="freed"):
        plan.dispatch()
    with pytest.raises(E.ArenaError, match="shader_mapping"):
        KvArena(1, 1, 8, 4, device=vk_device, shader_mapping="warp")


def test_too_large_is_refused_before_allocating(vk_device, monkeypatch):
    from kvdict_vk.vk import KvArena
    from kvdict_vk.vk.arena import memory as memory_mod

    def no_allocation(*a, **k):
        raise AssertionError("allocated before refusing")
    monkeypatch.setattr(memory_mod, "Buffer", no_allocation)
    lim = vk_device.info.limits["max_storage_buffer_range"]
    # one layer beyond maxStorageBufferRange (software drivers: 128 MiB per binding)
    n_ctx = lim // (2 * 8 * 128 * 4) + 1
    with pytest.raises(E.ArenaTooLargeError, match="maxStorageBufferRange"):
        KvArena(1, 8, 128, n_ctx, device=vk_device, cache="f32")
    # every layer fits, all of them together exceed the device heap
    per_layer = 2 * 8 * 128 * 4 * 4096
    n_layers = vk_device.info.device_local_bytes // per_layer + 2
    with pytest.raises(E.ArenaTooLargeError, match="heap"):
        KvArena(n_layers, 8, 128, 4096, device=vk_device, cache="f32")


def test_dictionary_that_does_not_fit_the_model(vk_device, activate):
    from kvdict_vk.vk import KvArena
    rng = np.random.default_rng(6)
    activate(random_artifact(rng, 16, 8, [(2, 2), (2, None)]))
    with pytest.raises(E.DictMismatchError, match="layers"):
        KvArena(3, 1, 16, 4, device=vk_device)
    with pytest.raises(E.DictMismatchError, match="head_dim"):
        KvArena(2, 1, 32, 4, device=vk_device)
    with KvArena(2, 1, 16, 4, device=vk_device) as a:
        assert a.mode == "dict"
    activate(random_artifact(rng, 16, 8, [(2, 2), (2, None)], n_heads=3))  # per-head, 3 KV heads
    with pytest.raises(E.DictMismatchError, match="KV heads"):
        KvArena(2, 2, 16, 4, device=vk_device)
    with KvArena(2, 3, 16, 4, device=vk_device) as a:
        assert a.mode == "dict" and a.layout.n_dict_heads == 3
        slots = random_slots(rng, runtime.clone_layer_dict(0, True), (3, 2))
        with pytest.raises(E.ShapeError):
            a.append_codes(0, slots[..., :-1], slots)  # a slot is slot_words wide
        a.append_codes(0, slots, slots)
    runtime.disable()  # toggle off: the next arena is the uncoded cache, dictionaries stay installed
    with KvArena(3, 1, 32, 4, device=vk_device) as a:
        assert a.mode == "f16"
    with pytest.raises(E.ArenaError, match="active dictionary"):
        KvArena(3, 1, 32, 4, device=vk_device, cache="dict")


def test_layout_is_fixed_at_creation(make_arena, activate, monkeypatch):
    rng = np.random.default_rng(7)
    art = random_artifact(rng, 16, 8, [(2, 2)])
    activate(art)
    calls = []
    real = runtime.snapshot
    monkeypatch.setattr(runtime, "snapshot", lambda: calls.append(1) or real())
    arena = make_arena(1, 1, 16, 8)
    assert len(calls) == 1  # one consistent snapshot, read once
    runtime.deactivate()  # a live arena keeps its dictionary
    kc = codec.pack_codes(rng.integers(0, 8, (1, 3, 2)), rng.standard_normal((1, 3, 2)))
    arena.append_codes(0, kc, kc)
    assert arena.mode == "dict"
    d = art.layers[0][0]
    assert nmse(codec.decode_heads(kc, d), arena.read(0)[0]) <= 1e-12
    x = _rows(rng, 1, 2, 16)
    arena.append(0, x, x)  # encodes with the arena's dictionary, not the (now empty) runtime
    assert arena.n_tokens(0) == 5


def test_guards_survive_every_operation(make_arena, activate):
    rng = np.random.default_rng(8)
    art = random_artifact(rng, 20, 64, [((3, 6), None), (None, (5, 2))], n_heads=2)
    activate(art)
    arena = make_arena(2, 2, 20, 30, guard_words=256)
    for layer in range(2):
        for t in (1, 7, 22):
            arena.append(layer, _rows(rng, 2, t, 20), _rows(rng, 2, t, 20))
        arena.read(layer)
        arena.read(layer, 29, 30)
        check_guards(arena)
