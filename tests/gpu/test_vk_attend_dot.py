"""attend_flash_dot (attend_flash.comp's KDOT builds): decode attention over q8_0 rows whose
keys' int8 levels are dotted with a two-part int8 query by integer dot products
(VK_KHR_shader_integer_dot_product), against the float64 reference over the same cached values
at the fast paths' gate (NMSE ≤ 1e-5, issue #50's decision), under the validation layer, every
arena guarded. Both builds: partial scores summed by subgroup shuffles and through shared memory.

lavapipe reports integer dot products, so CI runs every case; on a device without them the
build is never offered and forcing it is a typed error (test_offered_only_where_the_device_has_it)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_guards
from helpers import rising_keys
from kvdict_vk import errors as E
from kvdict_vk.cli.validate import NMSE_FAST as GATE  # the fast paths' gate (issue #50)
from kvdict_vk.forge import quant
from kvdict_vk.metrics import nmse
from kvdict_vk.vk import abi
from kvdict_vk.vk.attend.flash import INT_DOT_KERNEL
from kvdict_vk.vk.attend.specs import flash_units
from test_vk_attend import batched_within, reference

pytestmark = pytest.mark.gpu


def _has_dot(device) -> bool:
    return set(abi.DECLARATIONS["attend_flash_dot"].features) <= set(device.features())


def _q8_arena(make_arena, rng, n_kv, hd, n_ctx, k=None, v=None):
    """A q8_0 arena holding k and v (random rows where None) and what it holds, dequantised."""
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache="q8_0")
    k = rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32) if k is None else k
    v = rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32) if v is None else v
    for t0 in range(0, n_ctx, 1 << 14):
        arena.append(0, k[:, t0:t0 + (1 << 14)], v[:, t0:t0 + (1 << 14)])
    return arena, quant.q8_0(k), quant.q8_0(v)


def _forced(arena, q, shared: bool):
    """The arena's attention for q (n_heads, head_dim), or for each sequence's (B, n_heads,
    head_dim), with attend_flash_dot forced (shuffles or shared memory); where the device lacks
    integer dot products, None once an attention through it has raised the typed error."""
    att = arena.attention(q.shape[-2])
    att.path, att.flash_kernel, att.subgroups = "flash", INT_DOT_KERNEL, (False if shared else None)
    if _has_dot(arena.device):
        return att
    with pytest.raises(E.ArenaError, match="int_dot"):
        arena.attend(0, q, 1) if q.ndim == 2 else arena.attend_batch(0, q, [1] * len(q))
    return None


def _within_gate(arena, att, q, k, v, n_used, scale=None):
    plan = att.plan(0, n_used)
    assert plan.kernel == INT_DOT_KERNEL
    out = arena.attend(0, q, n_used, scale)
    ref = reference(q, k, v, None, None, n_used, scale)
    err = nmse(ref, out)
    assert err <= GATE, f"n_used {n_used}: NMSE {err:.3g}"
    return err


def test_offered_only_where_the_device_has_it(make_arena, monkeypatch):
    """int_dot fits a q8_0 layer exactly where the device reports integer dot products, and the
    tuner's builds include it then unless Attention.exact; never over f16 or f32 rows, where
    forcing it is a typed error. On a device without the feature (here pretended) it does not fit
    and the variant itself is refused before the driver sees it."""
    from kvdict_vk.vk import kernels
    for cache in ("q8_0", "f16", "f32"):
        arena = make_arena(1, 2, 64, 256, cache=cache)
        att = arena.attention(6)
        fits = cache == "q8_0" and _has_dot(arena.device)
        assert att.shapes.int_dot_fits(0) == fits
        assert (INT_DOT_KERNEL in att.shapes.flash_kernels(0)) == fits, cache
        assert bool(att.shapes.flash_kernel_locals(0, INT_DOT_KERNEL)) == fits
        att.exact = True
        assert INT_DOT_KERNEL not in att.shapes.flash_kernels(0)
        att.exact = False
        if cache != "q8_0":
            att.path, att.flash_kernel = "flash", INT_DOT_KERNEL
            with pytest.raises(E.ArenaError, match="int_dot"):
                att.plan(0, 100)
    arena = make_arena(1, 2, 64, 256, cache="q8_0")
    dev = arena.device
    without = tuple(f for f in dev.features() if f != "integer_dot")
    monkeypatch.setattr(type(dev), "features", lambda self: without)
    assert not arena.attention(4).shapes.int_dot_fits(0)
    buf = kernels.Buffer(dev, 1024, "storage", "x")
    try:
        with pytest.raises(E.DispatchError, match="integer_dot"):
            kernels.Kernel(dev, "attend_flash_dot", [buf] * 5, dict(HEAD_DIM=64, GROUP=3, LOCAL=64, HB=1, ROW_Q8=1),
                           max_items=64)
    finally:
        buf.destroy()


def test_q8_0_rows_only_at_the_contract():
    """attend_flash_dot's extents refuse a specialization over other rows (its keys are int8)."""
    from kvdict_vk.vk.attend import specs as S
    p = dict(k_word=0, v_word=4096, n_ctx=16, n_used=16, split_len=16, n_splits=1, n_kv=1, n_seqs=1, seq_rows=0,
             split_round=1, q_word=0)
    s = dict(HEAD_DIM=64, GROUP=2, LOCAL=64, HB=1, ROW_HALF=1, ROW_Q8=0, END_ELEMS=2)
    with pytest.raises(E.DispatchError, match="q8_0 rows"):
        S.EXTENTS["attend_flash_dot_sg"](p, s)
    assert S.EXTENTS["attend_flash_dot_sg"](p, dict(s, ROW_HALF=0, ROW_Q8=1))


@pytest.mark.parametrize("shared", [False, True], ids=["shuffles", "shared"])
@pytest.mark.parametrize("hd,g,n_kv,n_ctx", [(64, 3, 3, 5000), (128, 4, 2, 3000), (32, 8, 2, 1000),
                                             (64, 1, 1, 37), (128, 7, 1, 700), (64, 4, 2, 32768)])
def test_rows_within_the_gate(hd, g, n_kv, n_ctx, shared, make_arena):
    """Shapes of the grid: one token, token counts that are not whole rounds nor whole splits,
    many splits and one, odd query-head counts, an explicit score scale, a long context."""
    rng = np.random.default_rng(hd * 31 + g + n_ctx)
    arena, k, v = _q8_arena(make_arena, rng, n_kv, hd, n_ctx)
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    att = _forced(arena, q, shared)
    if att is None:
        return
    for workgroups in (None, 1):
        att.flash_workgroups = workgroups
        for n_used, scale in ((1, None), (17, None), (n_ctx // 2 + 3, None), (n_ctx, None), (n_ctx, 0.05)):
            _within_gate(arena, att, q, k, v, n_used, scale)
    plan = att.plan(0, n_ctx)
    sg = not shared and arena.device.shuffles_fit(flash_units(hd), plan.local)
    variant = "attend_flash_dot_sg" if sg else "attend_flash_dot"
    assert att.variant(0, plan) == variant and any(x[1] == variant for x in att.passes.pipeline_keys())
    check_guards(arena)


@pytest.mark.parametrize("shared", [False, True], ids=["shuffles", "shared"])
def test_awkward_queries_and_keys(shared, make_arena):
    """What quantising the query must survive: rising scores with a spike (the softmax reference
    moves dozens of times), an outlier key channel, a query block of zeros beside one of large
    values, and a query whose blocks differ in scale by 1e4. The error stays orders under the
    gate (the two-part query is within 1/508 of a level of its block's largest)."""
    rng = np.random.default_rng(5)
    hd, g, n_kv, n_ctx = 128, 4, 2, 3000
    q, k, v = rising_keys(rng, n_kv, g, hd, n_ctx)
    k[:, :, 7] *= 10.0  # an outlier channel
    q[0, :32] = 0.0  # a zero block
    q[1, 32:64] *= 1e4
    q[2, 64:96] *= 1e-4
    arena, kq, vq = _q8_arena(make_arena, rng, n_kv, hd, n_ctx, k, v)
    att = _forced(arena, q, shared)
    if att is None:
        return
    worst = max(_within_gate(arena, att, q, kq, vq, n_used) for n_used in (1, 300, n_ctx // 3 + 1, n_ctx))
    assert worst <= GATE * 1e-2


def test_non_finite_query_heads_are_nan(make_arena):
    """A query head holding a NaN or an infinity scores NaN (its output is NaN, as the float
    build's would be for a NaN); the other heads are untouched and within the gate."""
    rng = np.random.default_rng(9)
    hd, g, n_kv, n_ctx = 64, 3, 2, 500
    arena, k, v = _q8_arena(make_arena, rng, n_kv, hd, n_ctx)
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    q[1, 40] = np.nan
    q[4, 3] = np.inf
    att = _forced(arena, q, False)
    if att is None:
        return
    out = arena.attend(0, q, n_ctx)
    bad = np.zeros(len(q), bool)
    bad[[1, 4]] = True
    assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()
    full = reference(np.where(bad[:, None], 0.0, q), k, v, None, None, n_ctx)
    assert nmse(full[~bad], out[~bad]) <= GATE
    assert att.plan(0, n_ctx).kernel == INT_DOT_KERNEL


@pytest.mark.parametrize("shared", [False, True], ids=["shuffles", "shared"])
def test_batched_rows_within_the_gate(shared, make_arena):
    """B sequences of their own lengths over one arena (attend_batch: a sequence's KV head is a
    virtual head, its query blocks quantised from its own queries)."""
    lengths = (700, 1, 130, 33)
    rng = np.random.default_rng(21)
    n_kv, g, hd = 2, 3, 64
    arena = make_arena(1, n_kv, hd, max(lengths), cache="q8_0", seqs=len(lengths), guard_words=64)
    held = []
    for b, n in enumerate(lengths):
        k = rng.standard_normal((n_kv, n, hd), dtype=np.float32)
        v = rng.standard_normal((n_kv, n, hd), dtype=np.float32)
        arena.append(0, k, v, seq=b)
        held.append((quant.q8_0(k), quant.q8_0(v)))
    q = rng.standard_normal((len(lengths), n_kv * g, hd), dtype=np.float32)
    q[2] *= 30.0  # sequences whose queries differ in scale: each block keeps its own step
    att = _forced(arena, q, shared)
    if att is None:
        return
    for used in (list(lengths), [5, 1, 129, 2]):
        batched_within(arena, q, held, used, GATE)
    assert any(key[1].startswith("attend_flash_dot") for key in att.passes.pipeline_keys())
    check_guards(arena)


def test_smollm2_captured_kv_within_the_gate(make_arena):
    """Issue #50's gate on captured K/V: SmolLM2's own queries, keys and values (the forge's
    forward over 1 024 tokens of the demo's text) at four layers, each decode position's query
    heads against the q8_0 cache of the tokens up to it — real scores, with the model's outlier
    channels — within NMSE 1e-5 of the float64 reference over the same cached values."""
    from kvdict_vk.forge import llama, texts, tokenizer
    tokens = np.asarray(tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[:1024])
    qkv = llama.capture_qkv(tokens)
    worst = 0.0
    for layer in (0, 9, 19, len(qkv) - 1):
        q, k, v = qkv[layer]
        n_kv, n_ctx, hd = k.shape
        arena, kq, vq = _q8_arena(make_arena, None, n_kv, hd, n_ctx, k, v)
        att = _forced(arena, q[:, 0], False)
        if att is None:
            return
        for t in (0, 40, 511, n_ctx - 1):
            worst = max(worst, _within_gate(arena, att, q[:, t], kq, vq, t + 1))
        check_guards(arena)
    assert 0.0 < worst <= GATE, worst  # not the float query's result, and within the gate
