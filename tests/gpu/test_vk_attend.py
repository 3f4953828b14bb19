"""KvArena.attend: decode attention over the f32 cache and straight over the codes, against
the float64 NumPy twin (kvdict_vk.attention_ref), under the validation layer.

Slots go in with append_codes, so the GPU attends over exactly the words the reference
decodes; the reference for long contexts decodes in chunks (the same float64 math as
attention_ref.attend_coded, checked against it on short ones). Every arena is guarded.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import check_guards, stream_entry, random_artifact, stable_seed
from helpers import rising_keys
from kvdict_vk import attention_ref, codec
from kvdict_vk import errors as E
from kvdict_vk.metrics import nmse
from kvdict_vk.vk.attend import engine as attend
from kvdict_vk.vk.attend.specs import merge_head_local
from kvdict_vk.synthetic import random_slots

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 64, 128)
GQA = (1, 3, 8)
N_USED = (1, 7, 4096, 32768)
SPARSITIES = (1, 8, 16)
N_ATOMS = (256, 4096)


def reference(q, k, v, k_dict, v_dict, n_used, scale=None, chunk=2048):
    """attention_ref.attend_coded in float64, decoding `chunk` tokens at a time (the
    decoded cache of a 32k context would need gigabytes)."""
    q = np.asarray(q, np.float64)
    n_kv, hd = k.shape[0], q.shape[1]
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    qg = q.reshape(n_kv, -1, hd)

    def rows(x, d, t0, t1):
        return x[:, t0:t1].astype(np.float64) if d is None else codec.decode_heads(x[:, t0:t1], d, np.float64)
    scores = np.concatenate([np.einsum("kgd,ktd->kgt", qg, rows(k, k_dict, t0, min(t0 + chunk, n_used)))
                             for t0 in range(0, n_used, chunk)], axis=-1) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = sum(np.einsum("kgt,ktd->kgd", p[:, :, t0:min(t0 + chunk, n_used)], rows(v, v_dict, t0, min(t0 + chunk, n_used)))
              for t0 in range(0, n_used, chunk))
    return out.reshape(q.shape)


def batched_within(arena, q, held, n_used, gate):
    """attend_batch over sequences of their own lengths ``n_used``, each sequence b's output
    against the reference over ``held[b]`` (its cached (k, v) as stored) within NMSE ``gate``."""
    out = arena.attend_batch(0, q, n_used)
    for b, (k, v) in enumerate(held):
        err = nmse(reference(q[b], k, v, None, None, n_used[b]), out[b])
        assert err <= gate, f"sequence {b}, n_used {n_used[b]}: NMSE {err:.3g}"


def _stream(rng, d, n_kv, n_ctx, hd):
    return random_slots(rng, d, (n_kv, n_ctx)) if d is not None else rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32)


def _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art, cache="f32"):
    """An arena over `art` (None: the uncoded cache in `cache`'s row format) with every
    layer filled with random slots/rows. What it stores is what the cache holds: f16-rounded
    rows for an f16 cache (the reference attends over those)."""
    if art is not None:
        activate(art)
    n_layers = 1 if art is None else art.n_layers
    arena = make_arena(n_layers, n_kv, hd, n_ctx, guard_words=64, **({"cache": cache} if art is None else {}))
    assert arena.mode == (cache if art is None else "dict")
    stored = []
    for layer in range(n_layers):
        pair = (None, None) if art is None else art.layers[layer]
        k, v = (_stream(rng, d, n_kv, n_ctx, hd) for d in pair)
        for t0 in range(0, n_ctx, 1 << 14):  # a few appends
            arena.append_codes(layer, k[:, t0:t0 + (1 << 14)], v[:, t0:t0 + (1 << 14)])
        if arena.mode == "f16":
            k, v = (x.astype(np.float16).astype(np.float32) for x in (k, v))
        stored.append((k, v, *pair))
    return arena, stored


def _check(arena, stored, layer, q, n_used, scale=None, limit=1e-9):
    out = arena.attend(layer, q, n_used, scale)
    assert out.dtype == np.float32 and out.shape == q.shape
    k, v, kd, vd = stored[layer]
    ref = reference(q, k, v, kd, vd, n_used, scale)
    err = nmse(ref, out)  # infinite unless the NaN/±Inf positions agree
    assert err <= limit, f"layer {layer}, n_used {n_used}: NMSE {err:.3g}"
    return out


# (head_dim, GQA ratio, n_kv, n_atoms, per-head dictionaries, per layer (K, V): None =
# passthrough, s or (s, residual bits), n_ctx, n_used values). Hand-picked so every value of
# the grid appears — both sharings, with and without a residual stage, mixed layers — and
# the two 32768-token contexts stay few; plus seeded random draws below.
CASES = [
    (64, 3, 3, 256, True, (((8, 4), (8, 3)),), 4096, (1, 7, 4096)),
    (32, 8, 2, 4096, False, ((16, 16),), 4096, (1, 4096)),
    (128, 1, 4, 256, False, (((1, 2), None), (None, (1, 8))), 300, (1, 7, 300)),
    (64, 8, 1, 4096, True, (((8, 4), (8, 3)),), 32768, (7, 32768)),
    (128, 3, 2, 4096, True, ((None, 16), (None, None)), 32768, (32768, 1)),
]


def _random_cases(n: int, seed: int = 4242):
    rnd = random.Random(seed)
    out = []
    while len(out) < n:
        hd, g, na = rnd.choice(HEAD_DIMS), rnd.choice(GQA), rnd.choice(N_ATOMS)
        s = rnd.choice(SPARSITIES)
        bits = rnd.choice([(0, 0), (4, 3)])
        pair = tuple(rnd.choice([(s, b), (s, b), None]) for b in bits)
        if pair == (None, None):
            continue
        n_ctx = rnd.choice([7, 333, 4096])
        out.append((hd, g, rnd.randint(1, 3), na, rnd.random() < 0.5, (pair,), n_ctx,
                    tuple(sorted({1, min(7, n_ctx), n_ctx}))))
    return out


def _case_id(c):
    return f"hd{c[0]}-gqa{c[1]}-kv{c[2]}-na{c[3]}-{'perhead' if c[4] else 'shared'}-{c[5]}-ctx{c[6]}"


@pytest.mark.parametrize("case", CASES + _random_cases(3), ids=_case_id)
def test_coded_attention_equals_reference(case, make_arena, activate):
    hd, g, n_kv, na, per_head, layers, n_ctx, n_used_values = case
    rng = np.random.default_rng(stable_seed(case))
    art = random_artifact(rng, hd, na, layers, n_heads=n_kv if per_head else 1)
    arena, stored = _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for layer in range(len(layers)):
        for n_used in n_used_values:
            _check(arena, stored, layer, q, n_used)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=_case_id)
def test_gpu_mapping_equals_reference(case, make_arena, activate):
    """The GPU plan (workgroups of 64, many splits) on this device: same results."""
    hd, g, n_kv, na, per_head, layers, n_ctx, n_used_values = case
    rng = np.random.default_rng(11)
    art = random_artifact(rng, hd, na, layers, n_heads=n_kv if per_head else 1)
    activate(art)
    arena = make_arena(len(layers), n_kv, hd, n_ctx, shader_mapping="chunk")
    stored = []
    for layer, pair in enumerate(art.layers):
        k, v = (_stream(rng, d, n_kv, n_ctx, hd) for d in pair)
        arena.append_codes(layer, k, v)
        stored.append((k, v, *pair))
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    att = arena.attention(q.shape[0])
    assert att.local == 64 and att.preferred_splits > 4
    for layer in range(len(layers)):
        for n_used in n_used_values:
            _check(arena, stored, layer, q, n_used)


def test_splits_respect_llvmpipe_loop_limit(make_arena, activate):
    """llvmpipe silently ends an invocation's loops after 65535 iterations in total; one
    split over 8192 tokens of s = 16 codes (20 iterations a token) would be cut short.
    Even asked for one split, the engine splits under the budget — and stays exact."""
    from kvdict_vk.vk.attend import engine as A
    rng = np.random.default_rng(12)
    art = random_artifact(rng, 32, 256, [(16, 16)])
    arena, stored = _filled_arena(make_arena, activate, rng, 32, 1, 8192, art)
    att = arena.attention(1)
    att.preferred_splits = 1
    n_splits, split_len = att.splits(8192, 0)
    assert n_splits > 1 and split_len * A.loop_iterations(16, 16) <= A.LOOP_BUDGET < 65535
    _check(arena, stored, 0, rng.standard_normal((1, 32), dtype=np.float32), 8192)


def test_the_grid_is_covered():
    seen = {"hd": set(), "gqa": set(), "n_used": set(), "s": set(), "na": set(), "res": set(), "heads": set()}
    for hd, g, n_kv, na, per_head, layers, n_ctx, n_used in CASES:
        seen["hd"].add(hd)
        seen["gqa"].add(g)
        seen["na"].add(na)
        seen["n_used"].update(n_used)
        seen["heads"].add(per_head and n_kv > 1)
        for e in (e for p in layers for e in p if e is not None):
            s, bits = stream_entry(e)
            seen["s"].add(s)
            seen["res"].add(bits > 0)
    assert set(N_USED) <= seen.pop("n_used")
    assert seen == {"hd": set(HEAD_DIMS), "gqa": set(GQA), "s": set(SPARSITIES),
                    "na": set(N_ATOMS), "res": {False, True}, "heads": {False, True}}
    assert any(None in p and p != (None, None) for c in CASES for p in c[5])  # a mixed layer


@pytest.mark.parametrize("path", ["direct", "flash", "flash-shared", "flash-wide", "flash-wide-shared"])
@pytest.mark.parametrize("cache", ["f16", "f32"])
@pytest.mark.parametrize("hd,g,n_kv,n_ctx", [(64, 3, 3, 32768), (32, 8, 2, 4096), (128, 1, 4, 300)])
def test_uncoded_cache_attention_equals_reference(hd, g, n_kv, n_ctx, cache, path, make_arena):
    """The f16 cache against the float64 reference of its f16-rounded rows; f32 exactly so;
    both shaders (attend_direct, and attend_flash — the GPUs' default), attend_flash in both
    variants: partial scores summed by subgroup shuffles where the device's subgroups hold a
    token's lanes (attend_flash_sg), and through shared memory ("flash-shared", everywhere)."""
    from kvdict_vk.vk.attend.specs import flash_units
    rng = np.random.default_rng(hd * 1000 + g)
    arena, stored = _filled_arena(make_arena, None, rng, hd, n_kv, n_ctx, None, cache)
    att = arena.attention(n_kv * g)
    att.path = path.split("-")[0]
    att.subgroups = False if path.endswith("-shared") else None
    att.flash_kernel = "wide_end" if "wide" in path else None
    assert att.plan(0, n_ctx).path == att.path
    if att.path == "flash":
        local = att.plan(0, n_ctx).local
        fits = arena.device.shuffles_fit(flash_units(hd), local)
        shader = "attend_flash_wide" if "wide" in path else "attend_flash"
        assert att.shapes.flash_variant(local, shader) == (f"{shader}_sg" if fits and not path.endswith("-shared") else shader)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for n_used in sorted({1, 7, min(4096, n_ctx), n_ctx}):
        _check(arena, stored, 0, q, n_used)
    _check(arena, stored, 0, q, n_ctx, scale=0.05)  # an explicit scale


@pytest.mark.parametrize("path", ["flash", "flash-shared"])
@pytest.mark.parametrize("end_elems", [8, 4, 2, 1])
@pytest.mark.parametrize("kernel", ["float", "wide_end"])
def test_flash_end_in_any_number_of_passes(kernel, end_elems, path, make_arena, monkeypatch):
    """attend_flash's split end moves a unit's 8 elements through shared memory END_ELEMS at
    a time (attend.flash_end_elems: for the float builds attend_specs.FLASH_FLOAT_END_ELEMS,
    for the wide end the most the device holds of FLASH_END_ELEMS; forced to one value here —
    not every count is offered, some being slow, but each is correct): every pass count gives
    the reference, with 3 query heads (not a power of two) and token lanes of which some see
    no token (n_used 1 and 7)."""
    from kvdict_vk.vk.attend import flash as attend_module
    if kernel == "wide_end":
        monkeypatch.setattr(attend_module, "FLASH_END_ELEMS", (end_elems,))
    else:
        monkeypatch.setitem(attend_module.FLASH_FLOAT_END_ELEMS, kernel, end_elems)
    rng = np.random.default_rng(end_elems)
    hd, g, n_kv, n_ctx = 64, 3, 2, 3000
    arena, stored = _filled_arena(make_arena, None, rng, hd, n_kv, n_ctx, None, "f16")
    att = arena.attention(n_kv * g)
    att.path, att.flash_kernel = "flash", kernel
    att.subgroups = False if path == "flash-shared" else None
    local = att.shapes.flash_kernel_locals(0, kernel)[0]
    assert att.shapes.flash_end_elems(local, kernel) == end_elems and att.plan(0, n_ctx).kernel == kernel
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for n_used in (1, 7, 1500, n_ctx):
        _check(arena, stored, 0, q, n_used)


def test_flash_end_elems_that_do_not_divide_a_unit_are_refused(make_arena, monkeypatch):
    """An END_ELEMS whose passes would not cover a unit's 8 elements exactly (they would write
    past the unit) is refused by the kernel's contract before anything is dispatched, and the
    attention still works once a valid count is back."""
    from kvdict_vk.vk.attend import flash as attend_module
    rng = np.random.default_rng(3)
    hd, g, n_kv, n_ctx = 64, 3, 2, 600
    arena, stored = _filled_arena(make_arena, None, rng, hd, n_kv, n_ctx, None, "f16")
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    with monkeypatch.context() as m:
        m.setitem(attend_module.FLASH_FLOAT_END_ELEMS, "float", 3)
        att = arena.attention(n_kv * g)
        att.path, att.flash_kernel = "flash", "float"
        with pytest.raises(E.DispatchError, match=r"attend_flash \(specialization\)"):
            arena.attend(0, q, n_ctx)
    assert arena.attention(n_kv * g) is att and att.shapes.flash_end_elems(att.plan(0, n_ctx).local, "float") == 2
    _check(arena, stored, 0, q, n_ctx)


MERGE_HEAD_SOURCE = Path(__file__).resolve().parents[2] / "shaders" / "attend_merge_head.comp"


@pytest.mark.parametrize("workgroups", [1, 5, 1024])
def test_flash_merge_over_one_few_and_many_splits(workgroups, make_arena):
    """attend_merge_head merges a query head's records online, each split lane folding
    several records a round: one split, a few, and more splits than one round holds (split
    lanes × UNROLL; more than one record a lane in the last round, so lanes of empty splits
    and partly filled rounds both occur) — against the float64 reference. head_dim 128: 8
    split lanes of 32 quads, so MAX_SPLITS (128) is four rounds."""
    rng = np.random.default_rng(workgroups)
    hd, g, n_kv, n_ctx = 128, 4, 2, 20000
    # planned as for a GPU (splits up to MAX_SPLITS per KV head) on any device
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache="f16", shader_mapping="chunk")
    k, v = (rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32) for _ in range(2))
    arena.append(0, k, v)
    stored = [(k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32), None, None)]
    att = arena.attention(n_kv * g)
    att.path, att.flash_workgroups = "flash", workgroups
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    splits = []
    for n_used in (1, 129, n_ctx):
        plan = att.plan(0, n_used)
        assert plan.path == "flash"
        splits.append(plan.n_splits)
        _check(arena, stored, 0, q, n_used)
    unroll = int(re.search(r"const uint UNROLL = (\d+)u;", MERGE_HEAD_SOURCE.read_text()).group(1))
    one_round = merge_head_local(hd, att.max_local()) // (hd // 4) * unroll  # split lanes × UNROLL
    assert splits[0] == 1 and (max(splits) > one_round if workgroups == 1024 else True)
    assert (max(splits) > 1) == (workgroups // n_kv > 1)  # splits per KV head rounded down


def test_flash_workgroup_counts_come_from_the_multiprocessors(make_arena):
    """The flash kernels' candidate workgroup counts are multiples of the multiprocessors the
    device reports (powers of two where it reports none); a count's splits are rounded down,
    so an attention launches at most that many workgroups; counts whose splits the cap makes
    equal are one candidate."""
    from kvdict_vk.vk.attend import tune as T
    assert T.workgroup_counts(132, False) == (1056, 264, 528) and T.workgroup_counts(132, True) == (264, 132, 528)
    assert T.workgroup_counts(0, False) == (1024, 256, 512) and T.workgroup_counts(0, True) == (256, 128, 512)
    n_kv, g = 3, 3
    arena = make_arena(1, n_kv, 64, 45056, cache="f16", shader_mapping="chunk")
    att = arena.attention(n_kv * g)
    att.path, att.compute_units = "flash", 132
    shapes = att.shapes.flash_candidates(0)
    # 3 KV heads: 1 056 and 528 workgroups both reach the 128 splits' cap; 264 make 88 splits
    assert att.max_splits == attend.MAX_SPLITS
    for kernel in {sh.kernel for sh in shapes}:
        for local in {sh.local for sh in shapes if sh.kernel == kernel}:
            assert sorted(sh.workgroups for sh in shapes if (sh.kernel, sh.local) == (kernel, local)) == [264, 1056]
    assert [att.shapes.splits_wanted(sh) for sh in shapes[:2]] == [128, 88]
    for workgroups, splits in ((8, 2), (9, 3), (2, 1), (264, 88)):
        att.flash_workgroups = workgroups
        plan = att.plan(0, 45056)  # 88 splits of 512 tokens: whole rounds of 64 (test_flash_splits_are_whole_rounds)
        assert plan.n_splits == splits and plan.n_splits * n_kv <= max(workgroups, n_kv)


def test_flash_splits_are_whole_rounds(make_arena):
    """A flash split is a whole number of its kernel's rounds (attend_specs.flash_round_tokens;
    its tokens per lane and unit size the shader's): 32 768 tokens wanted in 33 splits of 993 would each run
    a last round of 32 whole, so they become 32 of 1 024; a length that is not a multiple leaves
    only the last split short."""
    from kvdict_vk.vk.attend import specs as S
    from kvdict_vk.vk.attend import tune as T
    flash_src = (MERGE_HEAD_SOURCE.parent / "attend_flash.comp").read_text()
    kivi_tb, rows_tb = re.search(r"#define TOKENS_PER_LANE \(KIVI > 0 \? (\d+)u : (\d+)u\)", flash_src).groups()
    assert (int(kivi_tb), int(rows_tb)) == (S.FLASH_KIVI_TOKENS_PER_LANE, S.FLASH_TOKENS_PER_LANE)
    assert int(re.search(r"const uint UNIT_DIMS = (\d+)u;", flash_src).group(1)) == S.FLASH_UNIT_DIMS
    assert S.flash_round_tokens(128, 256, coded=False) == 256 // 16 * S.FLASH_TOKENS_PER_LANE == 32
    assert S.flash_round_tokens(64, 256, coded=True) == 256
    # KIVI: a lane's tokens of a round share a key group, a split starts on one
    assert S.flash_round_tokens(64, 256, False, kivi=True) == 32 * S.FLASH_KIVI_TOKENS_PER_LANE == 256
    assert S.flash_round_tokens(128, 64, False, kivi=True) == 32  # 4 lanes × 8 tokens: a round a group
    n_kv, g, hd = 2, 4, 128
    arena = make_arena(1, n_kv, hd, 40000, cache="f16", shader_mapping="chunk")
    att = arena.attention(n_kv * g)
    for n_used, n_splits, split_len in ((32768, 32, 1024), (39000, 33, 1184), (1000, 8, 128), (100, 1, 100)):
        plan = att.shapes.flash_shaped(n_used, T.Shape(256, 66))  # 33 splits wanted
        assert (plan.n_splits, plan.split_len) == (n_splits, split_len)
        assert (plan.n_splits - 1) * plan.split_len < n_used <= plan.n_splits * plan.split_len


@pytest.mark.parametrize("cache", ["f16", "f32", "q8_0"])
def test_flash_reference_moves_with_rising_scores(cache, make_arena):
    """attend_flash keeps a softmax reference that moves only when a score passes it by a
    margin: keys whose scores rise along the context (by ~0.05 a token, so the reference
    moves dozens of times, within and across chunks and splits) and one spike far above the
    rest, against the float64 reference."""
    from kvdict_vk.forge import quant
    rng = np.random.default_rng(11)
    hd, g, n_kv, n_ctx = 64, 4, 2, 3000
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache=cache)
    q, k, v = rising_keys(rng, n_kv, g, hd, n_ctx)
    arena.append(0, k, v)
    if cache == "f16":
        k, v = (x.astype(np.float16).astype(np.float32) for x in (k, v))
    elif cache == "q8_0":
        k, v = quant.q8_0(k), quant.q8_0(v)
    att = arena.attention(n_kv * g)
    att.path = "flash"
    for n_used in (1, 300, n_ctx // 3 + 1, n_ctx):
        assert att.plan(0, n_used).path == "flash"
        _check(arena, [(k, v, None, None)], 0, q, n_used)


@pytest.mark.parametrize("hd,g,n_kv,n_ctx", [(64, 3, 3, 32768), (32, 8, 2, 4096), (128, 1, 4, 300)])
def test_q8_0_cache_attention_equals_reference(hd, g, n_kv, n_ctx, make_arena):
    """The q8_0 cache (attend_flash on every device) against the float64 reference of its
    dequantised rows; attend_direct cannot read q8_0 rows: forcing it is a typed error."""
    from kvdict_vk.forge import quant
    rng = np.random.default_rng(hd * 100 + g)
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache="q8_0")
    k = rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32)
    for t0 in range(0, n_ctx, 1 << 14):
        arena.append(0, k[:, t0:t0 + (1 << 14)], v[:, t0:t0 + (1 << 14)])
    stored = [(quant.q8_0(k), quant.q8_0(v), None, None)]
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    att = arena.attention(n_kv * g)
    assert att.plan(0, n_ctx).path == "flash"
    for n_used in sorted({1, 7, min(4096, n_ctx), n_ctx}):
        _check(arena, stored, 0, q, n_used)
    with pytest.raises(E.ArenaError, match="q8_0"):
        att.plan(0, 10, path="direct")


def test_flash_path_needs_a_layer_it_fits(make_arena, activate):
    """The flash kernels read uncoded rows (attend_flash) or a layer whose streams are both
    dict-coded (attend_flash_coded): forcing one on a mixed layer is a typed error, and the
    planner never picks it there."""
    rng = np.random.default_rng(12)
    arena, stored = _filled_arena(make_arena, activate, rng, 32, 2, 64, random_artifact(rng, 32, 16, [((2, 3), None)]))
    att = arena.attention(4)
    assert att.plan(0, 64).path in ("direct", "table") and not att.shapes.flash_fits(0)
    with pytest.raises(E.ArenaError, match="flash"):
        att.plan(0, 64, path="flash")


@pytest.mark.parametrize("path", ["direct", "table", "flash"])
@pytest.mark.parametrize("hd,n_kv,g,per_head", [(64, 3, 3, True), (32, 2, 4, False), (128, 1, 2, False)])
def test_binary16_atoms_on_every_coded_path(hd, n_kv, g, per_head, path, make_arena, activate):
    """Atoms that are binary16 values (as the forge's are): the arena keeps them once, in
    binary16 (shaders/atoms.glsl), and every coded path — attend_direct, attend_table +
    attend_atoms, attend_flash_coded — reads them exactly (1e-9 against float64 over the same
    slots, out-of-range code words included), K or V uncoded in one layer."""
    rng = np.random.default_rng(hd + 7 * n_kv + g)
    pairs = [((4, 4), (4, 3)), ((2, 0), None), (None, (3, 5))]
    art = random_artifact(rng, hd, 96, pairs, n_heads=n_kv if per_head else 1, f16_atoms=True)
    activate(art)
    n_ctx = 333
    arena = make_arena(len(pairs), n_kv, hd, n_ctx, guard_words=64)
    assert all(st.atoms_f16 for ll in arena.layout.layers for st in ll.streams)
    stored = []
    for layer, (kd, vd) in enumerate(art.layers):
        k, v = (rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32) if d is None
                else random_slots(rng, d, (n_kv, n_ctx), out_of_range=0.05) for d in (kd, vd))
        arena.append_codes(layer, k, v)
        stored.append((k, v, kd, vd))
    att = arena.attention(n_kv * g)
    att.path = path
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for layer, (kd, vd) in enumerate(art.layers):
        if path == "flash" and (kd is None or vd is None):
            continue  # attend_flash_coded serves layers with both streams coded
        for n_used in (1, 130, n_ctx):
            assert att.plan(layer, n_used).path == path
            _check(arena, stored, layer, q, n_used)
    check_guards(arena)


# (head_dim, n_kv, GQA, n_atoms, per-head dictionaries, ((K s, K bits), (V s, V bits)), n_ctx)
FLASH_CODED_CASES = [
    (64, 3, 3, 256, True, ((4, 4), (4, 3)), 2000),   # SmolLM2's shape, the certified format
    (64, 2, 4, 1024, True, ((4, 4), (4, 3)), 700),
    (32, 2, 8, 64, False, ((2, 0), (3, 5)), 300),    # atoms only for K, a shared dictionary
    (128, 1, 1, 128, False, ((8, 2), (1, 0)), 129),
    (64, 2, 2, 512, True, ((1, 8), (16, 1)), 1100),
    (64, 2, 4, 1024, True, ((4, 4), (4, 3)), 32768),  # a long split: many chunks into the same atom weights
]


@pytest.mark.parametrize("case", FLASH_CODED_CASES, ids=lambda c: "hd{}-kv{}-g{}-a{}-{}-ctx{}".format(*c[:4], c[5], c[6]))
def test_flash_coded_attention_equals_reference(case, make_arena, activate):
    """The GPUs' kernel over the codes (attend_flash_coded) against the float64 reference over
    the same slots, out-of-range code words included (they contribute zero)."""
    hd, n_kv, g, n_atoms, per_head, pair, n_ctx = case
    rng = np.random.default_rng(stable_seed(case))
    art = random_artifact(rng, hd, n_atoms, [pair], n_heads=n_kv if per_head else 1)
    activate(art)
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64)
    kd, vd = art.layers[0]
    k = random_slots(rng, kd, (n_kv, n_ctx), out_of_range=0.05)
    v = random_slots(rng, vd, (n_kv, n_ctx), out_of_range=0.05)
    arena.append_codes(0, k, v)
    att = arena.attention(n_kv * g)
    att.path = "flash"
    assert att.shapes.flash_coded_heads(0) >= 1
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for n_used in sorted({1, 129, n_ctx // 2 + 1, n_ctx}):
        p = att.plan(0, n_used)
        assert p.path == "flash" and p.kernel == "float"
        _check(arena, [(k, v, kd, vd)], 0, q, n_used)
    _check(arena, [(k, v, kd, vd)], 0, q * 40, n_ctx)  # large scores: the running maximum moves


@pytest.mark.parametrize("bucket", ["smallest", "largest"])
@pytest.mark.parametrize("local", [256, 64])
def test_flash_coded_crowded_atoms_take_more_passes(local, bucket, make_arena, activate, monkeypatch):
    """attend_flash_coded hands each V code word to the invocation owning its atom, through a
    bucket of BUCKET words per pass. Code words crowding onto a few atoms fill the buckets and
    take further passes in the same chunk: every code word of a stretch of tokens on one atom,
    then on atoms sharing one owner (a, a + LOCAL, …), then on two owners, then spread — the
    reference's output at the smallest bucket and the largest, at the largest and smallest
    workgroup (so with the fewest and the most atoms owned per invocation)."""
    from kvdict_vk.vk.attend import flash as F, specs as S, tune as T
    monkeypatch.setattr(F, "FLASH_CODED_LOCALS", (local,))
    monkeypatch.setattr(T, "_CHOICES", {})  # where the device tunes: no shape measured by another case
    if bucket == "smallest":
        monkeypatch.setattr(S, "FLASH_CODED_BUCKET", (S.FLASH_CODED_BUCKET[0],) * 2)
    rng = np.random.default_rng(stable_seed(("crowded", local, bucket)))
    hd, n_kv, g, n_atoms, n_ctx = 64, 2, 2, 512, 1500
    art = random_artifact(rng, hd, n_atoms, [((4, 4), (4, 3))], n_heads=n_kv)
    activate(art)
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64)
    kd, vd = art.layers[0]
    k = random_slots(rng, kd, (n_kv, n_ctx))
    v = random_slots(rng, vd, (n_kv, n_ctx), out_of_range=0.05)
    idx, coef = codec.unpack_codes(v[..., :vd.sparsity])
    t = np.arange(n_ctx)[None, :, None]
    j = np.arange(vd.sparsity)[None, None, :]
    crowded = np.select([t < 300, t < 600, t < 900],
                        [np.full_like(idx, 7), 7 + local * (j % (n_atoms // local)), 7 + (t % 2) * 100], idx)
    idx = np.where(idx < n_atoms, crowded, idx)  # the out-of-range words stay (they contribute zero)
    v = v.copy()
    v[..., :vd.sparsity] = codec.pack_codes(idx, coef)
    arena.append_codes(0, k, v)
    att = arena.attention(n_kv * g)
    att.path, att.coded_kernel = "flash", "float"
    assert att.shapes.flash_coded_options(0, "float") == [(2, [local]), (1, [local])]
    least = S.FLASH_CODED_BUCKET[0]
    assert (att.shapes.flash_coded_bucket(0, 2, local) == least) == (bucket == "smallest")  # else larger
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for n_used in (299, 700, n_ctx):
        assert att.plan(0, n_used).local == local
        _check(arena, [(k, v, kd, vd)], 0, q, n_used)
    _check(arena, [(k, v, kd, vd)], 0, q * 40, n_ctx)  # the reference moves: owned weights rescale


def test_chunked_reference_is_attend_coded(make_arena):
    """The test's reference equals attention_ref.attend_coded where that one fits memory."""
    rng = np.random.default_rng(3)
    art = random_artifact(rng, 32, 64, [((4, 3), (2, 5))], n_heads=2)
    kd, vd = art.layers[0]
    k, v = random_slots(rng, kd, (2, 50)), random_slots(rng, vd, (2, 50))
    q = rng.standard_normal((6, 32), dtype=np.float32)
    for n_used in (1, 17, 50):
        want = attention_ref.attend_coded(q, k, v, kd, vd, n_used)
        assert np.allclose(reference(q, k, v, kd, vd, n_used, chunk=16), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["f32", "dict"])
def test_large_scores_do_not_overflow(mode, make_arena, activate):
    """Softmax overflow guard: q × 1e3 makes scores of order 1e4 (exp would overflow
    without the maximum subtracted) — output finite and equal to the reference."""
    rng = np.random.default_rng(5)
    hd, n_kv, g, n_ctx = 64, 2, 3, 600
    art = None if mode == "f32" else random_artifact(rng, hd, 256, [((8, 4), (8, 3))], n_heads=n_kv)
    arena, stored = _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32) * 1e3
    for n_used in (1, 2, n_ctx):
        out = _check(arena, stored, 0, q, n_used)
        assert np.isfinite(out).all()


@pytest.mark.parametrize("path", ["direct", "flash"])
def test_reconstruct_then_attend_baseline(path, make_arena, activate):
    """The benchmark's third mode (GPU reconstruct into f32 rows, then attend_direct or
    attend_flash over them) gives the same attention."""
    rng = np.random.default_rng(6)
    hd, n_kv, g, n_ctx = 64, 3, 3, 1000
    art = random_artifact(rng, hd, 256, [((8, 4), (8, 3))])
    arena, stored = _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art)
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    att = arena.attention(n_kv * g)
    for n_used in (1, 999):
        att.path = path
        assert att.rows_plan(n_used).path == path
        got = att.attend_reconstructed(0, q, n_used, 1 / 8)
        att.path = None
        k, v, kd, vd = stored[0]
        assert nmse(reference(q, k, v, kd, vd, n_used), got) <= 1e-9
        assert nmse(arena.attend(0, q, n_used), got) <= 1e-9


def test_typed_errors(make_arena, activate, vk_device):
    rng = np.random.default_rng(7)
    art = random_artifact(rng, 16, 32, [((2, 3), None), (None, None)])
    activate(art)
    arena = make_arena(2, 2, 16, 10)
    kd = art.layers[0][0]
    arena.append_codes(0, random_slots(rng, kd, (2, 10)), rng.standard_normal((2, 10, 16), dtype=np.float32))
    arena.append(1, rng.standard_normal((2, 4, 16), dtype=np.float32), rng.standard_normal((2, 4, 16), dtype=np.float32))
    q = rng.standard_normal((4, 16), dtype=np.float32)
    assert arena.attend(0, q, 10).shape == (4, 16)
    for bad in (q.astype(np.float64), q.astype(np.float16), q.tolist(), q[None], q[:, :8], q[:3], q[:0],
                np.zeros((4, 17), np.float32)):
        with pytest.raises(E.ShapeError):
            arena.attend(0, bad, 5)
    for n_used in (0, -1, 11, 1.0, True, "3", None):
        with pytest.raises(E.ArenaError):
            arena.attend(0, q, n_used)
    with pytest.raises(E.ArenaError, match="appended"):
        arena.attend(1, q, 5)  # layer 1 holds 4 tokens
    for scale in (float("nan"), float("inf"), "0.1", True):
        with pytest.raises(E.ShapeError):
            arena.attend(0, q, 5, scale)
    for layer in (-1, 2, True, "0"):
        with pytest.raises(E.LayerIndexError):
            arena.attend(layer, q, 5)
    att = arena.attention(4)
    att.path, att.flash_kernel = "flash", "fixed"  # no build of attend_flash
    with pytest.raises(E.ArenaError, match="flash_kernel"):
        att.plan(1, 4)
    att.path, att.flash_kernel = None, None
    assert arena.attend(1, q, 4).shape == (4, 16)  # the attention is usable as before
    arena.free()
    with pytest.raises(E.ArenaError, match="freed"):
        arena.attend(0, q, 5)
    from kvdict_vk import runtime
    from kvdict_vk.vk import KvArena
    runtime.deactivate()  # the f32 cache (the fixture restores the dictionaries)
    with KvArena(1, 1, 18, 4, device=vk_device) as odd:  # head_dim % 4 != 0: no vec4 rows
        odd.append(0, np.ones((1, 2, 18), np.float32), np.ones((1, 2, 18), np.float32))
        with pytest.raises(E.ArenaError, match="head_dim"):
            odd.attend(0, np.ones((2, 18), np.float32), 2)


def test_attention_recording_reruns_and_times_its_passes(make_arena):
    """Attention.recording (the benchmarks' re-runnable attention): every run() gives the
    output attend() gives; its core (the passes, without the query's and output's copies)
    is timed inside the whole recording where the device has timestamps; a core outside
    the ops is a typed error."""
    from kvdict_vk.vk.submit import Recording
    rng = np.random.default_rng(12)
    arena, stored = _filled_arena(make_arena, None, rng, 64, 2, 500, None, "f16")
    att = arena.attention(4)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    want = arena.attend(0, q, 500)
    with att.recording(0, q, 500, timestamps=True) as rec:
        assert rec.core[0] == 1 and rec.core[1] >= 2  # after the query copy; the output copy after it
        for _ in range(2):
            rec.run()
            assert np.array_equal(att.output(), want)
        whole, core = rec.gpu_seconds(), rec.core_seconds()
        assert (whole is None) == (core is None) == (not rec.timestamps)
        if whole is not None:
            assert 0 <= core <= whole
    with pytest.raises(E.DispatchError, match="core ops"):
        Recording(arena.device, [object()], core=(0, 2))


def test_timestamps_only_where_a_recording_reads_them(make_arena):
    """scripts/kp_patch.py item 3: a sequence latches timestamps only after the ops recorded
    with record() — numbered as written, so get_timestamps returns those and none other — and
    Recording latches around its core and at its end ("spans": no timestamp inside a timed
    span), or after every op ("ops"), where the per-op times add up to the spans."""
    from kvdict_vk.vk import submit
    assert submit.HAS_UNLATCHED, "kp lacks Sequence.record_unlatched: scripts/setup.sh patches it"
    rng = np.random.default_rng(13)
    arena, _ = _filled_arena(make_arena, None, rng, 64, 2, 300, None, "f16")
    dev = arena.device
    assert submit.timestamps_usable(dev), f"{dev.name}: no usable timestamps on the compute queue"
    att = arena.attention(4)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    want = arena.attend(0, q, 300)
    up, back = att.passes.q_upload(att.q), att.passes.read_back(att.out)
    with dev.guard("a sequence of two copies, the second latched"):
        seq = dev.manager.sequence(0, 2)  # room for two after the first: one is written
        seq.record_unlatched(up)
        seq.record(back)
        seq.eval()
        stamps = seq.get_timestamps()
        seq.destroy()
    assert len(stamps) == 2 and stamps[1] >= stamps[0]
    with att.recording(0, q, 300, timestamps="spans") as spans, att.recording(0, q, 300, timestamps="ops") as ops:
        for rec in (spans, ops):
            rec.run()
            assert np.array_equal(att.output(), want)
        with pytest.raises(E.DispatchError, match="timestamps='ops'"):
            spans.op_seconds()
        per_op = ops.op_seconds()
        assert len(per_op) == ops.core[1] + 1 and min(per_op) >= 0  # the query's copy, the passes, the read-back
        tick = dev.info.limits["timestamp_period_ns"] * 1e-9
        assert abs(sum(per_op) - ops.gpu_seconds()) <= len(per_op) * tick
        assert abs(sum(per_op[slice(*ops.core)]) - ops.core_seconds()) <= len(per_op) * tick
        assert 0 <= spans.core_seconds() <= spans.gpu_seconds()
    with pytest.raises(E.DispatchError, match="timestamps must be"):
        submit.Recording(dev, [up], timestamps="every")


@pytest.mark.parametrize("coded,path", [(False, None), (True, "table"), (True, "flash")])
def test_a_recording_may_flush_the_l2_in_its_own_submission(coded, path, make_arena, activate):
    """Attention.recording(flush_bytes=…): l2_flush (a read that writes nothing back) and a
    barrier between the query's copy and the passes, in the same submission; primed=True:
    the passes once more ahead of the flush, then a barrier (the table path's atom weights
    are zero again after a completed attention). The output is unchanged, run after run,
    the core is still the passes alone and comes last — and l2_flush's contract: whole
    vec4s, within its source (a typed error before dispatch)."""
    from kvdict_vk.vk import submit
    from kvdict_vk.vk.kernels import Buffer, Kernel
    rng = np.random.default_rng(14)
    art = random_artifact(rng, 64, 256, [((4, 4), (4, 3))], n_heads=2) if coded else None
    arena, stored = _filled_arena(make_arena, activate if coded else None, rng, 64, 2, 300, art, "f16")
    att = arena.attention(4)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    want = reference(q, *stored[0], 300, None)
    with att.recording(0, q, 300, path=path, timestamps="ops") as plain, \
            att.recording(0, q, 300, path=path, timestamps="ops", flush_bytes=1 << 20) as flushed, \
            att.recording(0, q, 300, path=path, timestamps="ops", flush_bytes=1 << 20, primed=True) as primed:
        n_core = plain.core[1] - plain.core[0]
        assert flushed.core[0] == plain.core[0] + 2  # the flush and its barrier ahead of the passes
        assert primed.core[0] == flushed.core[0] + n_core + 1  # the passes and a barrier ahead of those
        assert primed.core[1] - primed.core[0] == flushed.core[1] - flushed.core[0] == n_core
        for rec in (flushed, plain, primed, primed, flushed):
            rec.run()
            out = att.output()
            assert np.isfinite(out).all() and nmse(want, out) <= 1e-9
        assert primed.untimed == (1, primed.core[0]) and flushed.untimed == (1, flushed.core[0])
        assert plain.untimed is None
        tick = arena.device.info.limits["timestamp_period_ns"] * 1e-9
        for rec in (flushed, primed):  # gpu_seconds: the whole submission less the flush and the priming
            per_op = rec.op_seconds()
            assert len(per_op) == rec.core[1] + 1  # the core, then the read-back: the last op
            timed = sum(per_op) - sum(per_op[slice(*rec.untimed)])
            assert abs(rec.gpu_seconds() - timed) <= len(per_op) * tick
    with pytest.raises(E.DispatchError, match="must come before the core"):
        submit.Recording(arena.device, [att.passes.q_upload(att.q), att.passes.read_back(att.out)],
                         core=(0, 1), untimed=(1, 2))
    dev = arena.device
    src, sink = Buffer(dev, 64, "storage", "flush source"), Buffer(dev, 4, "storage", "flush sink")
    kernel = Kernel(dev, "l2_flush", [src, sink], max_items=16)
    try:
        for words in (6, 68):
            with pytest.raises(E.DispatchError):
                kernel.op(n_words=words)
        kernel.op(n_words=64)
    finally:
        kernel.destroy()
        sink.destroy()
        src.destroy()


@pytest.mark.parametrize("coded", [False, True])
def test_flash_launch_shape_is_measured_once_per_bucket(coded, make_arena, activate, monkeypatch):
    """On GPUs the flash kernels' launch shape (workgroup size, workgroups) is the fastest
    of the candidates timed on the device, once per (device, layer signature, context
    bucket): the plan follows the measurement, a second attention in the bucket measures
    nothing, another bucket measures again, and the tuned attention is still exact."""
    from kvdict_vk.vk.attend import tune as T
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "WARM_S", 0.0)
    rng = np.random.default_rng(13)
    hd, n_kv, g, n_ctx = 64, 2, 2, 3000
    art = random_artifact(rng, hd, 256, [((4, 4), (4, 3))], n_heads=n_kv) if coded else None
    arena, stored = _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art, "f16")
    att = arena.attention(n_kv * g)
    att.path, att.tune = "flash", True
    att.compute_units = 7  # planned as on a GPU of 7 multiprocessors: counts 7 × attend_tune's multiples
    counts = T.workgroup_counts(7, coded)
    if coded:  # the query heads per workgroup are a dimension of the search
        assert [hb for hb, _ in att.shapes.flash_coded_options(0, "float")] == [2, 1]
        offered = T.candidates(att.shapes.flash_coded_options(0, "float"), counts, "float")
    else:  # the build (its split's end) is a dimension too; over f16 rows: not the int8 dot products
        from kvdict_vk.vk.attend.flash import FLASH_KERNELS, INT_DOT_KERNEL
        kernels = att.shapes.flash_kernels(0)
        assert kernels == tuple(k for k in FLASH_KERNELS if k != INT_DOT_KERNEL)
        assert att.shapes.flash_kernel_locals(0, INT_DOT_KERNEL) == []
        assert all(att.shapes.flash_kernel_locals(0, kernel) == att.shapes.flash_locals(0) for kernel in kernels)
        offered = [sh for kernel in kernels
                   for sh in T.candidates([(0, att.shapes.flash_kernel_locals(0, kernel))], counts, kernel)]
    what = lambda x: (x.local, x.heads, x.kernel)  # noqa: E731
    shapes = att.shapes.flash_candidates(0)  # offered, less counts whose splits come out alike
    assert shapes[0] == offered[0] and set(shapes) <= set(offered) and all(sh.workgroups % 7 == 0 for sh in shapes)
    assert {what(sh) for sh in shapes} == {what(sh) for sh in offered}
    assert len({(what(sh), att.shapes.splits_wanted(sh)) for sh in shapes}) == len(shapes) >= 2
    favourite = shapes[-1]  # coded: one query head per workgroup, the smallest size; else the wide end
    timed = []

    def fake_time(layer, n_used, plan):  # the device's "measurement": the favourite is fastest
        timed.append((what(plan), plan.n_splits))
        blocks = n_kv * (g // plan.heads if plan.heads else 1)
        assert plan.n_splits * blocks <= max(counts)  # splits rounded down: never past a count
        return 1e-3 - 1e-7 * plan.n_splits if what(plan) == what(favourite) else 2e-3
    monkeypatch.setattr(att, "time_plan", fake_time)
    from kvdict_vk.vk.attend import engine as A
    monkeypatch.setattr(A, "timestamps_usable", lambda dev: True)
    p = att.plan(0, 1500)
    assert len(timed) == T.ROUNDS * len(shapes) and what(p) == what(favourite)
    assert p.n_splits == max(n for w, n in timed if w == what(favourite))
    assert att.plan(0, 2000).local == favourite.local and len(timed) == T.ROUNDS * len(shapes)  # same bucket
    att.plan(0, 3000)
    assert len(timed) == 2 * T.ROUNDS * len(shapes)  # bucket 4096: measured again
    assert len(T.measured()) == 2
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    _check(arena, stored, 0, q, 1500)


def test_flash_coded_heads_per_workgroup_fixed_by_the_caller(make_arena, activate):
    """Attention.coded_heads fixes attend_flash_coded's query heads per workgroup: each count
    the layer allows gives the reference's output; one it does not is refused, typed."""
    rng = np.random.default_rng(15)
    hd, n_kv, g, n_ctx = 32, 2, 4, 700
    art = random_artifact(rng, hd, 64, [((4, 3), (2, 4))], n_heads=n_kv)
    arena, stored = _filled_arena(make_arena, activate, rng, hd, n_kv, n_ctx, art, "f16")
    att = arena.attention(n_kv * g)
    att.path = "flash"
    allowed = [hb for hb, _ in att.shapes.flash_coded_options(0)]
    assert allowed == [4, 2, 1]
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    for hb in allowed:
        att.coded_heads = hb
        assert att.plan(0, n_ctx).heads == hb
        _check(arena, stored, 0, q, n_ctx)
    att.coded_heads = 3
    with pytest.raises(E.ArenaError, match="3 query heads per workgroup"):
        att.plan(0, n_ctx)
    att.coded_heads, att.coded_kernel = None, "halves"
    with pytest.raises(E.ArenaError, match="coded_kernel"):
        att.plan(0, n_ctx)


def test_flash_launch_shape_timing_runs_on_the_device(make_arena):
    """The tuner's timing function runs the attention's passes in a recording: a time (or
    None without timestamps), and the output of a later attention unchanged."""
    rng = np.random.default_rng(14)
    arena, stored = _filled_arena(make_arena, None, rng, 64, 2, 700, None, "f16")
    att = arena.attention(4)
    att.path = "flash"
    plan = att.plan(0, 700)
    s = att.time_plan(0, 700, plan)
    assert s is None or s > 0
    _check(arena, stored, 0, rng.standard_normal((4, 64), dtype=np.float32), 700)


def test_tuner_timing_can_flush_the_l2_first(make_arena, monkeypatch):
    """attend_tune.FLUSH_BYTES > 0: time_plan reads that many bytes of scratch ahead of the
    timed passes (flush_ops: buffers made once per size, freed with the engine) — a time as
    before, the attention's output untouched; and the tuner remembers its choices per setting and per set
    of candidates offered."""
    from kvdict_vk.vk.attend import tune as T
    rng = np.random.default_rng(16)
    arena, stored = _filled_arena(make_arena, None, rng, 64, 2, 700, None, "f16")
    att = arena.attention(4)
    att.path = "flash"
    plan = att.plan(0, 700)
    monkeypatch.setattr(T, "FLUSH_BYTES", 1 << 20)
    s = att.time_plan(0, 700, plan)
    assert s is None or s > 0
    made = dict(att.buffers.flush_scratch)
    assert list(made) == [(1 << 20) // 4]  # words read
    att.time_plan(0, 700, plan)
    assert att.buffers.flush_scratch == made  # not made again
    _check(arena, stored, 0, rng.standard_normal((4, 64), dtype=np.float32), 700)
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "WARM_S", 0.0)
    calls = []
    shapes = [T.Shape(64, 8), T.Shape(64, 16)]
    T.choose(("sig",), 700, shapes, lambda sh: calls.append(sh) or 1e-3)
    T.choose(("sig",), 700, shapes, lambda sh: calls.append(sh) or 1e-3)
    once = len(calls)
    monkeypatch.setattr(T, "FLUSH_BYTES", 0)
    T.choose(("sig",), 700, shapes, lambda sh: calls.append(sh) or 1e-3)
    assert once == T.ROUNDS * len(shapes) and len(calls) == 2 * once  # remembered per setting
    other = [T.Shape(128, 8), T.Shape(128, 16)]  # the kernel's build changed: other candidates
    assert T.choose(("sig",), 700, other, lambda sh: calls.append(sh) or 1e-3) in other
    assert len(calls) == 3 * once
    att.free()
    assert att.buffers.flush_scratch == {}  # freed with the engine


def test_flash_layer_facts_are_derived_once_per_layer(make_arena, monkeypatch):
    """What planning reads of a layer on every step — the flash kernels' workgroup sizes,
    whether one fits, the tuner's layer signature — depends on the layout, the group and the
    device's limits only: derived on the first plan, not again on later ones."""
    from kvdict_vk.vk.attend import engine as A, flash as F
    from kvdict_vk.vk.attend import tune as T
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "WARM_S", 0.0)
    arena, _ = _filled_arena(make_arena, None, np.random.default_rng(15), 64, 2, 700, None, "f16")
    att = arena.attention(4)
    att.path, att.tune = "flash", True
    calls = {"units": 0, "signature": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(F, "flash_units", counting("units", F.flash_units))
    monkeypatch.setattr(T, "layer_signature", counting("signature", T.layer_signature))
    monkeypatch.setattr(A, "timestamps_usable", lambda dev: True)
    monkeypatch.setattr(att, "time_plan", lambda layer, n_used, plan: 1e-3)
    first = [att.plan(0, n) for n in (100, 300, 700)]
    derived = dict(calls)  # units: the sizes, and each build's end per workgroup size
    assert derived["signature"] == 1 and 1 <= derived["units"] <= 1 + len(A.FLASH_KERNELS) * len(att.shapes.flash_locals(0))
    assert [att.plan(0, n) for n in (100, 300, 700)] == first and calls == derived
    assert T.signature(att.shapes.layer_signature(0), 700) in T.measured()
    locals_ = att.shapes.flash_locals(0)
    locals_.clear()  # the caller's copy: the cached sizes stay
    assert att.shapes.flash_locals(0) and att.shapes.flash_local(0) == first[0].local


def test_workgroup_sizes_keep_within_both_device_limits():
    """Attention.max_local — the bound of every workgroup size the attention chooses
    (flash kernels, attend_merge_head) — is the lesser of maxComputeWorkGroupInvocations
    and maxComputeWorkGroupSize[0]."""
    import types
    from kvdict_vk.vk.attend.engine import Attention
    from kvdict_vk.vk.attend.specs import merge_head_local

    def fake(invocations, size_x):
        limits = {"max_compute_work_group_invocations": invocations,
                  "max_compute_work_group_size": (size_x, 1024, 64)}
        return types.SimpleNamespace(device=types.SimpleNamespace(limit=limits.__getitem__))
    assert Attention.max_local(fake(1024, 128)) == 128 and Attention.max_local(fake(64, 1024)) == 64
    assert merge_head_local(128, Attention.max_local(fake(1024, 1024))) == 256
    assert merge_head_local(128, Attention.max_local(fake(1024, 128))) == 128  # not 256: size[0] is 128
