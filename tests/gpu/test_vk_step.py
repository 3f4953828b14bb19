"""KvArena.step (append + attend in one submission) and both attention paths forced.

A decode step reads its new tokens from the upload buffer and the older ones from the
layer; the paths (direct: decode each key/value; table: q·atom table, never decoding) are
chosen by a cost model. Here each is checked against the float64 reference over the very
code words the arena stores (codec.encode_heads is deterministic), and against an arena
fed by append + attend.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import GPU_FASTER, random_artifact
from kvdict_vk import codec
from kvdict_vk.metrics import nmse
from test_vk_attend import CASES, _case_id, _check, _filled_arena, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["direct", "table"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=_case_id)
def test_forced_paths_equal_reference(case, path, make_arena, activate):
    hd, g, n_kv, na, per_head, layers, n_ctx, n_used_values = case
    rng = np.random.default_rng(21)
    art = random_artifact(rng, hd, na, layers, n_heads=n_kv if per_head else 1)
    arena, stored = _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    att = arena.attention(q.shape[0])
    att.path = path
    for layer in range(len(layers)):
        for n_used in n_used_values:
            k, v = art.layers[layer]
            assert att.plan(layer, n_used).path == (path if (k or v) else "direct")
            _check(arena, stored, layer, q, n_used)


def _rows(rng, n_kv, t, hd):
    # real-looking: an offset per head plus noise, so OMP has something to fit
    base = rng.standard_normal((n_kv, 1, hd)).astype(np.float32)
    return (base + 0.3 * rng.standard_normal((n_kv, t, hd))).astype(np.float32)


@pytest.mark.parametrize("path", [None, "direct", "table"])
@pytest.mark.parametrize("mode", ["f16", "f32", "dict", "mixed"])
def test_step_equals_append_then_attend(mode, path, make_arena, activate):
    hd, n_kv, g, n_ctx = 32, 2, 3, 6200
    rng = np.random.default_rng(31)
    uncoded = mode in ("f16", "f32")
    if not uncoded:
        pair = ((8, 4), (8, 3)) if mode == "dict" else ((8, 4), None)
        activate(random_artifact(rng, hd, 64, [pair], n_heads=n_kv))
    cache = {"cache": mode} if uncoded else {}
    stepped = make_arena(1, n_kv, hd, n_ctx, **cache)
    plain = make_arena(1, n_kv, hd, n_ctx, **cache)
    assert stepped.mode == plain.mode == ("dict" if mode == "mixed" else mode)
    att = stepped.attention(n_kv * g)
    att.path = path
    # a long prefill first (beyond one fresh split: the two-submission fallback), then
    # a short one (fresh rows through the upload buffer), then single tokens
    chunks = [min(att.max_fresh_tokens(0) + 17, n_ctx - 100), 40] + [1] * 6
    k_all, v_all = [], []
    t = 0
    for n in chunks:
        k, v = _rows(rng, n_kv, n, hd), _rows(rng, n_kv, n, hd)
        q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
        got = stepped.step(0, k, v, q)
        plain.append(0, k, v)
        t += n
        want = plain.attend(0, q, t)
        assert stepped.n_tokens(0) == t
        assert nmse(want, got) <= 1e-9, f"after {t} tokens"
        k_all.append(k)
        v_all.append(v)
    # the float64 reference over the stored words (encode is deterministic)
    k_all, v_all = np.concatenate(k_all, 1), np.concatenate(v_all, 1)
    from kvdict_vk import runtime
    kd = vd = None
    if not uncoded:
        kd, vd = runtime.clone_layer_dict(0, True), runtime.clone_layer_dict(0, False)
    if mode == "f16":  # the cache holds the rows rounded to f16
        k_all, v_all = (x.astype(np.float16).astype(np.float32) for x in (k_all, v_all))
    k_w = k_all if kd is None else codec.encode_heads(k_all, kd)
    v_w = v_all if vd is None else codec.encode_heads(v_all, vd)
    assert nmse(reference(q, k_w, v_w, kd, vd, t), got) <= 1e-9
    # the step's tokens really are in the layer: a later plain attend sees them
    assert nmse(plain.attend(0, q, t), stepped.attend(0, q, t)) <= 1e-12


@pytest.mark.parametrize("cache", ["f16", "f32", "q8_0"])
def test_flash_step_equals_append_then_attend(cache, make_arena):
    """A decode step whose attention is attend_flash (it reads the layer after the step's
    scatter and barrier, not the upload buffer) equals append + attend, token after token."""
    hd, n_kv, g, n_ctx = 64, 2, 4, 700
    rng = np.random.default_rng(32)
    stepped = make_arena(1, n_kv, hd, n_ctx, cache=cache)
    plain = make_arena(1, n_kv, hd, n_ctx, cache=cache)
    stepped.attention(n_kv * g).path = "flash"
    t = 0
    for n in [600, 3, 1, 1]:
        k, v = _rows(rng, n_kv, n, hd), _rows(rng, n_kv, n, hd)
        q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
        got = stepped.step(0, k, v, q)
        plain.append(0, k, v)
        t += n
        assert stepped.n_tokens(0) == t and nmse(plain.attend(0, q, t), got) <= 1e-9, f"after {t} tokens"


def test_flash_coded_step_equals_append_then_attend(make_arena, activate):
    """A decode step over a dict-coded layer through attend_flash_coded (reading the slots
    the step's scatter wrote, after its barrier) equals append + attend."""
    hd, n_kv, g, n_ctx = 64, 2, 3, 800
    rng = np.random.default_rng(33)
    activate(random_artifact(rng, hd, 128, [((4, 4), (4, 3))], n_heads=n_kv))
    stepped = make_arena(1, n_kv, hd, n_ctx)
    plain = make_arena(1, n_kv, hd, n_ctx)
    stepped.attention(n_kv * g).path = "flash"
    t = 0
    for n in [700, 2, 1]:
        k, v = _rows(rng, n_kv, n, hd), _rows(rng, n_kv, n, hd)
        q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
        got = stepped.step(0, k, v, q)
        plain.append(0, k, v)
        t += n
        assert nmse(plain.attend(0, q, t), got) <= 1e-9, f"after {t} tokens"


def test_step_checks_before_writing(make_arena, activate):
    from kvdict_vk import errors as E
    rng = np.random.default_rng(41)
    activate(random_artifact(rng, 16, 32, [((2, 3), (2, 3))]))
    arena = make_arena(1, 2, 16, 8)
    k = rng.standard_normal((2, 3, 16), dtype=np.float32)
    q = rng.standard_normal((4, 16), dtype=np.float32)
    arena.step(0, k, k, q)
    for bad_q in (q[:3], q.astype(np.float64)):
        with pytest.raises(E.ShapeError):
            arena.step(0, k, k, bad_q)
    with pytest.raises(E.ShapeError):
        arena.step(0, k[:, :, :8], k, q)
    with pytest.raises(E.ArenaError):
        arena.step(0, np.concatenate([k, k], 1), np.concatenate([k, k], 1), q)  # 3 + 6 > n_ctx 8
    assert arena.n_tokens(0) == 3  # nothing appended by the failed calls


@pytest.mark.parametrize("pair", [((8, 4), (8, 3)), ((4, 0), None), (None, (16, 0))])
def test_gpu_encoder_write_path(pair, make_arena, activate):
    """KvArena(encoder="gpu"): the slots the device writes reconstruct like the CPU codec's
    (same atoms on well-conditioned input, same error), through append and step, with the
    arena's guards intact (make_arena checks them)."""
    hd, n_kv, g, n_ctx = 64, 3, 3, 300
    rng = np.random.default_rng(51)
    art = random_artifact(rng, hd, 256, [pair], n_heads=n_kv)
    activate(art)
    gpu = make_arena(1, n_kv, hd, n_ctx, encoder="gpu")
    cpu = make_arena(1, n_kv, hd, n_ctx, encoder="cpu")
    assert (gpu.encoder, cpu.encoder) == ("gpu", "cpu")
    x = [(_rows(rng, n_kv, n, hd), _rows(rng, n_kv, n, hd)) for n in (200, 1, 1, 30)]
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for i, (k, v) in enumerate(x):
        if i % 2:
            gpu.step(0, k, v, q)
            cpu.step(0, k, v, q)
        else:
            gpu.append(0, k, v)
            cpu.append(0, k, v)
    assert gpu.n_tokens(0) == cpu.n_tokens(0) == 232
    k_all = np.concatenate([k for k, _ in x], 1)
    v_all = np.concatenate([v for _, v in x], 1)
    (kg, vg), (kc, vc) = gpu.read(0), cpu.read(0)
    for want, got_gpu, got_cpu, coded in ((k_all, kg, kc, pair[0]), (v_all, vg, vc, pair[1])):
        err_gpu, err_cpu = nmse(want, got_gpu), nmse(want, got_cpu)
        if coded is None:
            assert err_gpu == err_cpu == 0.0
        else:
            assert abs(err_gpu - err_cpu) <= 1e-4 * err_cpu, (err_gpu, err_cpu)
    assert nmse(cpu.attend(0, q, 232), gpu.attend(0, q, 232)) <= 1e-6


def test_encoder_choice(make_arena, activate, monkeypatch):
    from kvdict_vk import errors as E
    from kvdict_vk.vk.arena import config as A
    monkeypatch.setenv(A.ENCODER_ENV, "GPU")
    assert make_arena(1, 1, 8, 4).encoder == "gpu"
    monkeypatch.delenv(A.ENCODER_ENV)
    assert make_arena(1, 1, 8, 4, encoder=None).encoder == "auto"
    with pytest.raises(E.ArenaError, match="encoder"):
        make_arena(1, 1, 8, 4, encoder="tpu")


def test_auto_encoder_is_measured_once_per_format_and_batch(make_arena, activate, monkeypatch):
    """encoder="auto": the CPU codec on a CPU driver without a measurement; on a GPU (or
    lavapipe posing as one) both encoders timed on the first append of each (format, batch
    bucket), the faster kept — the choice follows the measurement, is not measured again,
    and the slots either way reconstruct like the codec's."""
    from kvdict_vk.vk.encode import choice as C
    from kvdict_vk.vk.device import Device
    monkeypatch.setattr(C, "_CHOICES", {})
    hd, n_kv, n_ctx = 32, 2, 400
    rng = np.random.default_rng(52)
    activate(random_artifact(rng, hd, 64, [((4, 4), (4, 0))], n_heads=n_kv))
    arena = make_arena(1, n_kv, hd, n_ctx, encoder="auto")
    k, v = _rows(rng, n_kv, 100, hd), _rows(rng, n_kv, 100, hd)
    arena.append(0, k, v)
    # a CPU driver: the codec, no measurement (recorded all the same); a GPU: measured on this first append
    assert len(C.measured()) == 1
    assert not arena.device.is_cpu or set(C.measured().values()) == {"cpu"}
    monkeypatch.setattr(C, "_CHOICES", {})
    monkeypatch.setattr(Device, "is_cpu", property(lambda self: False))
    calls = []
    monkeypatch.setattr(C, "_measure", lambda *a: calls.append(a) or GPU_FASTER)
    arena.append(0, k, v)
    arena.append(0, k[:, :90], v[:, :90])  # the same bucket (≤ 128 tokens): no measurement
    arena.append(0, k[:, :1], v[:, :1])    # a decode-sized append: measured for its bucket
    assert len(calls) == 2 and set(C.measured().values()) == {"gpu"}
    monkeypatch.undo()
    monkeypatch.setattr(C, "_CHOICES", {})
    monkeypatch.setattr(Device, "is_cpu", property(lambda self: False))
    monkeypatch.setattr(C, "_SECONDS", {})
    choice = C.choose(arena.memory, 0, (k, v), arena.stream_dict, arena.gpu_encoder)  # the real measurement: both encoders run
    assert choice in ("cpu", "gpu") and len(C.measured()) == 1
    (parts,) = C.measurements().values()  # what it timed, and the choice follows it
    assert all(parts[p] > 0 for p in ("cpu_s", "gpu_s", "gpu_first_s"))
    assert choice == ("gpu" if parts["gpu_s"] < parts["cpu_s"] else "cpu")
    monkeypatch.undo()
    want = np.concatenate([k, k, k[:, :90], k[:, :1]], 1)
    got, _ = arena.read(0)
    assert nmse(want, got) <= 2 * nmse(want[:, :100], got[:, :100]) + 1e-6


@pytest.mark.parametrize("mapping", ["row", "chunk"])
def test_no_pipeline_is_made_mid_decode(mapping, make_arena, activate):
    """The first attention of a layer makes every pipeline its plans may need: as the
    context grows and the plan changes (CPU drivers: one direct split → several + merge →
    the table passes; GPUs: attend_flash_coded throughout), no pipeline is compiled
    mid-decode (a stall of ~80 ms per layer on llvmpipe)."""
    rng = np.random.default_rng(61)
    hd, n_kv, g = 32, 2, 3
    activate(random_artifact(rng, hd, 256, [((8, 4), (8, 3))], n_heads=n_kv))
    arena = make_arena(1, n_kv, hd, 4096, shader_mapping=mapping)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    arena.step(0, _rows(rng, n_kv, 1, hd), _rows(rng, n_kv, 1, hd), q)
    att = arena.attention(n_kv * g)
    made = att.passes.pipeline_keys()
    paths = set()
    for n in (40, 400, 3000):
        arena.append(0, _rows(rng, n_kv, n, hd), _rows(rng, n_kv, n, hd))
        t = arena.n_tokens(0)
        paths.add((att.plan(0, t).path, att.plan(0, t).write_out))
        arena.step(0, _rows(rng, n_kv, 1, hd), _rows(rng, n_kv, 1, hd), q)
    if mapping == "row":
        assert len(paths) >= 2, paths  # the plan did change
    else:
        assert paths == {("flash", False)}, paths
    assert att.passes.pipeline_keys() == made
