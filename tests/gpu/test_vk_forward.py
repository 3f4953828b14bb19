"""DeviceForward: a llama model's decode on the device, one submission a token (issue 52,
item 2), against the forge's NumPy forward over the same weights and the same cache values.

Per token the device's logits give the next token's NLL; the forge's batched forward
(kvdict_vk.forge.llama.token_nll), with a hook that holds K/V as the cache holds them (f32,
binary16; q8_0 over the arena's own values, see CacheAsHeld), gives it from the same numbers:
the two agree within 1e-3 nats (the issue's gate) — on a small random model of awkward shapes (every weight format, both matvec shapes)
and on the real SmolLM2's first tokens. The greedy token a run returns is its logits' argmax.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk import rows as R
from kvdict_vk.forge import llama
from kvdict_vk.model_file import ModelConfig
from kvdict_vk.rope import KeyRope
from kvdict_vk.vk.forward import DeviceForward, random_weights
from kvdict_vk.forge.gguf_model import dequantised_model
from kvdict_vk.vk.forward.weights import BLOCK_WORDS, Matrix, dequantised, f32_matrix

pytestmark = pytest.mark.gpu
NLL_GATE = 1e-3  # nats per token (issue 52)


class CacheAsHeld(llama.KVHook):
    """Attention over K/V as the cache holds them: the forge's K/V in row format ``cache``
    (f32, binary16) — or, for q8_0, the arena's own values after the device's decode: q8_0
    rounds to steps of a block's max / 127, so a value a float32 ulp away from the forge's can
    land a step away, and the forward over a q8_0 cache is compared over the cache's values
    (which :meth:`check_rows` holds to the forge's within a step). Records the forge's K/V."""

    def __init__(self, arena, cache: str):
        self.arena, self.cache, self.kv = arena, cache, []

    def __call__(self, layer, k, v):
        self.kv.append((k, v))
        if self.cache in ("q8_0", "dict"):  # the arena's own values (a dict cache: its slots decoded)
            return self.arena.read(layer)
        return R.held_rows(k, self.cache), R.held_rows(v, self.cache)

    def check_rows(self) -> None:
        """The rows the device appended are the model's K/V as the cache holds them (q8_0:
        within one quantisation step of a block's largest value)."""
        tol = {"f32": 1e-4, "f16": 2e-3, "q8_0": 1.01 / 127}[self.cache]
        for layer, (k, v) in enumerate(self.kv):
            for got, want in zip(self.arena.read(layer), (k, v)):
                assert np.abs(got - R.held_rows(want, self.cache)).max() <= tol * np.abs(want).max(), f"layer {layer}"


def _nll(logits: np.ndarray, target: int) -> float:
    x = logits.astype(np.float64)
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()) - x[target])


def _decode(forward: DeviceForward, tokens) -> tuple[np.ndarray, list]:
    """Teacher-forced: every token fed; the NLL of each next one and the greedy picks."""
    nll, picks = [], []
    for i, tok in enumerate(tokens):
        picks.append(forward.run(int(tok)))
        logits = forward.logits()
        assert picks[-1] == int(np.argmax(logits))
        if i + 1 < len(tokens):
            nll.append(_nll(logits, int(tokens[i + 1])))
    return np.array(nll), picks


def _small_model(rng, fmt: str, tied: bool, hidden: int = 96, head_dim: int = 32) -> tuple:
    """A random 2-layer model: hidden 96 (three blocks), 6 query heads over 2 KV heads of 32,
    ffn 160, a vocabulary of 300; random norms (ones would hide a norm bug), and where
    ``fmt`` is "mixed" every layer matrix in another format."""
    cfg = ModelConfig("llama", 2, hidden, 6, 2, head_dim, 160, 10000.0, head_dim, 1e-5, 300, 64, tied)
    w = random_weights(cfg, rng, "q4_1" if fmt == "mixed" else fmt)
    norm = lambda: (0.5 + rng.random(cfg.hidden)).astype(np.float32)  # noqa: E731
    layers = []
    for i, layer in enumerate(w.layers):
        changes = dict(attn_norm=norm(), ffn_norm=norm())
        if fmt == "mixed":
            changes["wv"] = f32_matrix(dequantised(layer.wv))
            changes["w_up"] = random_weights(dataclasses.replace(cfg, n_layers=1), rng, "q8_0").layers[0].w_up
        layers.append(dataclasses.replace(layer, **changes))
    return dataclasses.replace(w, layers=tuple(layers), output_norm=norm())


# subgroups: the matvecs' _sg builds (a row's lanes added by shuffles: every device the suite runs
# on has them at subgroups of 8 or more), their shared-memory trees, or the device's choice
@pytest.mark.parametrize("fmt,cache,tied,row_threads,subgroups", [
    ("q4_1", "f32", True, 1, None), ("q4_1", "f16", False, 16, False), ("q8_0", "q8_0", True, 4, True),
    ("q4_1", "f16", True, 8, True), ("f32", "f16", True, 64, None), ("mixed", "f32", False, 1, None),
    ("mixed", "q8_0", False, 2, True)])
def test_small_model_equals_the_numpy_forward(fmt, cache, tied, row_threads, subgroups, make_arena):
    rng = np.random.default_rng(60)
    w = _small_model(rng, fmt, tied)
    _check_forward(w, cache, row_threads, subgroups, make_arena, rng)


@pytest.mark.parametrize("row_threads,subgroups", [(1, None), (8, True), (16, False)])
def test_a_wide_residual_is_normed_from_memory(row_threads, subgroups, make_arena):
    """hidden past matvec.glsl's X_SHARED (2048 columns): Q/K/V, gate + up and the LM head read
    the normed residual from memory a row at a time, not from shared memory."""
    rng = np.random.default_rng(62)
    _check_forward(_small_model(rng, "q8_0", True, hidden=2080), "f32", row_threads, subgroups, make_arena, rng)


@pytest.mark.parametrize("fmt,row_threads,subgroups", [("q4_1", 1, None), ("q8_0", 8, True), ("f32", 16, False)])
def test_matvecs_past_their_workgroups_stride_the_grid(fmt, row_threads, subgroups, make_arena, monkeypatch):
    """Two workgroups a matvec: every row past them is reached by fwd_matvec's and fwd_qkv's
    grid stride (at SmolLM2's shapes only the LM head strides)."""
    import kvdict_vk.vk.forward.model as fwd_model
    monkeypatch.setattr(fwd_model, "MATVEC_WORKGROUPS", 2)
    rng = np.random.default_rng(63)
    _check_forward(_small_model(rng, fmt, False), "f32", row_threads, subgroups, make_arena, rng)


# q8_0: a pair of blocks (64 elements) completed by workgroups of 2, 8, 32 or 64 rows an
# iteration (row threads 32, 8, 2, 1) — head_dim 32 (one block, the pair's second missing), 64,
# 128; KIVI: a KV head's K and V rows, over enough tokens that groups leave the window — and
# by one workgroup (grid stride: rows after a group's quantisation, which borrows the staged x)
@pytest.mark.parametrize("cache,row_threads,head_dim,workgroups", [
    ("f16", 8, 32, None), ("f32", 8, 32, None), ("q8_0", 8, 32, None), ("q8_0", 32, 64, None),
    ("q8_0", 1, 128, None), ("q8_0", 2, 64, None), ("kivi", 8, 32, None), ("kivi", 32, 64, None),
    ("kivi", 1, 64, None), ("kivi", 8, 64, 1)])
def test_qkv_appends_the_rows_the_step_would(cache, row_threads, head_dim, workgroups, make_arena, monkeypatch):
    """Over f16, f32 or q8_0 rows or a KIVI layer fwd_qkv appends the token's K and V into the
    layer and the token records no append (two ops a layer fewer): the arena's rows and words
    and every token's logits equal, bit for bit, those of the forward whose decode step appends."""
    from kvdict_vk import kivi as K
    if workgroups is not None:
        import kvdict_vk.vk.forward.model as fwd_model
        monkeypatch.setattr(fwd_model, "MATVEC_WORKGROUPS", workgroups)
    rng = np.random.default_rng(65)
    w = _small_model(rng, "q4_1", True, head_dim=head_dim)
    cfg = w.config
    spec = K.KiviSpec(4, 2, 8) if cache == "kivi" else None
    tokens = rng.integers(0, cfg.vocab, 10 if spec is None else 32 + spec.recent + 36)
    got = {}
    for appends in (True, False):
        arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(tokens) + 14, cache=cache,
                           **({"kivi": spec} if spec else {}))
        forward = DeviceForward(w, arena, logits=True, row_threads=row_threads, qkv_appends=appends)
        logits = []
        for tok in tokens:
            forward.run(int(tok))
            logits.append(forward.logits())
        got[appends] = (len(forward.op_labels), np.array(logits), [arena.read(i) for i in range(cfg.n_layers)],
                        [arena.layer_words(i).copy() for i in range(cfg.n_layers)])
        assert all(forward.step.row_append(j) is not None for j in range(cfg.n_layers))
        forward.free()
    assert got[True][0] == got[False][0] - 2 * cfg.n_layers
    assert np.array_equal(got[True][1], got[False][1])
    for fused, stepped in zip(got[True][2], got[False][2]):
        for a, b in zip(fused, stepped):
            assert np.array_equal(a, b)
    for fused, stepped in zip(got[True][3], got[False][3]):  # the stored words too (q8_0: blocks, scales)
        assert np.array_equal(fused, stepped)


# a batch: sequences of their own lengths (a prefix of random rows each), decoded together; the
# matvecs a sequence a workgroup or 2 or 3 at once (seq_tile; 2 of 3: a tile of one left); the
# sequences strided over by fewer workgroup rows than there are where the device's limit is
# patched down to one (the shaders' gl_NumWorkGroups.y stride)
@pytest.mark.parametrize("cache,row_threads,subgroups,seq_tile,seq_rows", [
    ("f32", 1, None, 1, None), ("f16", 8, True, 3, None), ("q8_0", 16, False, 2, None), ("kivi", 8, True, 1, None),
    ("f16", 4, True, 1, 1), ("f32", 2, True, 2, 1)])
def test_a_batch_decodes_each_sequence_as_it_would_alone(cache, row_threads, subgroups, seq_tile, seq_rows,
                                                         make_arena, vk_device, monkeypatch):
    """DeviceForward(batch=B).run_batch: each sequence's logits, greedy tokens and appended rows
    are those of a forward over that sequence alone (the same prefix, the same tokens), within
    the attention's float differences (a batch's splits are planned for the batch)."""
    from kvdict_vk import kivi as K
    if seq_rows is not None:
        limits = vk_device.info.limits
        monkeypatch.setitem(limits, "max_compute_work_group_count",
                            (limits["max_compute_work_group_count"][0], seq_rows, 1))
    rng = np.random.default_rng(66)
    w = _small_model(rng, "q4_1", True)
    cfg, B, steps = w.config, 3, 12
    kw = {"kivi": K.KiviSpec(4, 2, 8)} if cache == "kivi" else {}
    prefix = [5, 0, 60]  # rows already in each sequence (KIVI: the third one's second group leaves its window at 72)
    n_ctx = max(prefix) + steps + 2
    rows = [[rng.standard_normal((2, cfg.n_kv_heads, n, cfg.head_dim), dtype=np.float32) for n in prefix]
            for _ in range(cfg.n_layers)]
    tokens = rng.integers(0, cfg.vocab, (steps, B))
    batch_arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_ctx, cache=cache, seqs=B, **kw)
    alone = [make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_ctx, cache=cache, **kw) for _ in range(B)]
    for layer in range(cfg.n_layers):
        for s in range(B):
            if prefix[s]:
                batch_arena.append(layer, *rows[layer][s], seq=s)
                alone[s].append(layer, *rows[layer][s])
    batched = DeviceForward(w, batch_arena, logits=True, row_threads=row_threads, subgroups=subgroups, batch=B,
                            seq_tile=seq_tile)
    singles = [DeviceForward(w, a, logits=True, row_threads=row_threads, subgroups=subgroups) for a in alone]
    for t in range(steps):
        picks = batched.run_batch(tokens[t])
        logits = batched.logits()
        assert logits.shape == (B, cfg.vocab) and picks.shape == (B,)
        assert np.array_equal(picks, logits.argmax(1))
        for s, single in enumerate(singles):
            pick = single.run(int(tokens[t, s]))
            want = single.logits()
            assert np.abs(logits[s] - want).max() <= 1e-4 * np.abs(want).max(), (t, s)
            assert picks[s] == pick, (t, s)
    # the rows: each sequence's own, at its positions — within a step of the format, as the K/V the two
    # forwards made differ by the attention's float differences (binary16: 2^-11 of the largest
    # value; q8_0: a block's largest / 127; KIVI: a group's range over its 2-bit values' 3 steps)
    tol = {"f32": 1e-4, "f16": 1e-3, "q8_0": 1.01 / 127, "kivi": 1.01 / 3}[cache]
    for layer in range(cfg.n_layers):
        for s in range(B):
            assert batch_arena.n_tokens(layer, s) == prefix[s] + steps
            for got, want in zip(batch_arena.read(layer, seq=s), alone[s].read(layer)):
                assert np.abs(got - want).max() <= tol * np.abs(want).max(), (layer, s)
    for f in (batched, *singles):
        f.free()


def test_a_batch_is_checked(make_arena):
    """run_batch's tokens, run on a batch, a batch past the arena's sequences or over a range of
    layers: typed errors, nothing written."""
    rng = np.random.default_rng(67)
    w = _small_model(rng, "q4_1", True)
    cfg = w.config
    arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, cache="f16", seqs=2)
    with pytest.raises(E.ArenaError):
        DeviceForward(w, arena, batch=3)
    with pytest.raises(E.ShapeError):
        DeviceForward(w, arena, batch=2, layers=(0, 1))
    for bad in (dict(batch=0), dict(batch=2, seq_tile=0), dict(batch=2, seq_tile=9), dict(batch=2, seq_tile=True)):
        with pytest.raises(E.ShapeError):
            DeviceForward(w, arena, **bad)
    forward = DeviceForward(w, arena, batch=2)
    for bad in ([1], [1, 2, 3], [1, cfg.vocab], [-1, 0], np.array([0.5, 1.0]), [True, False]):
        with pytest.raises(E.ShapeError):
            forward.run_batch(bad)
    with pytest.raises(E.ArenaError):
        forward.run(1)
    assert [arena.n_tokens(0, s) for s in range(2)] == [0, 0]
    assert forward.run_batch([1, 2]).shape == (2,)
    assert [arena.n_tokens(i, s) for i in range(cfg.n_layers) for s in range(2)] == [1] * 4
    forward.free()


def _check_forward(w, cache, row_threads, subgroups, make_arena, rng):
    cfg = w.config
    tokens = rng.integers(0, cfg.vocab, 12)
    arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 40, cache=cache)
    forward = DeviceForward(w, arena, logits=True, row_threads=row_threads, subgroups=subgroups)
    assert forward.subgroups == bool(subgroups)  # None here: 1 or 64 invocations a row, no shuffles
    got, _ = _decode(forward, tokens)
    ref = CacheAsHeld(arena, cache)
    want = llama.token_nll(tokens, ref, model=dequantised_model(w))
    assert np.abs(got - want).max() <= NLL_GATE, np.abs(got - want).max()
    assert all(arena.n_tokens(i) == len(tokens) for i in range(cfg.n_layers))
    ref.check_rows()
    (rec,) = forward._recs  # noqa: SLF001 — a label for each op of its one submission's core
    assert len(forward.op_labels) == rec.core[1] - rec.core[0] and set(forward.op_labels) == {
        "step values", "embedding", "qkv + rope", "append + attention", "o", "gate + up", "down", "lm head", "argmax"}
    forward.free()
    assert forward.closed


@pytest.mark.parametrize("bits,recent", [((4, 4), 8), ((3, 2), 20)])
def test_kivi_cache_equals_the_forge_kivi_forward(bits, recent, make_arena):
    """Over a KIVI cache the device forward (its windows filled and its groups quantised on the
    device: append_kivi.comp) gives the forge's forward with KIVI's windows (forge.kivi.KiviHook's:
    each query over the groups quantised by then, the rest binary16) within the NLL gate, over
    enough tokens that groups leave the window. As for q8_0 (CacheAsHeld) the quantised values
    are the arena's own — a level a float32 ulp from a rounding boundary may land a step away
    from NumPy's — and they are held to the host quantiser's over the forge's K/V."""
    from kvdict_vk import kivi as K
    from kvdict_vk.forge.kivi import KiviHook
    from kvdict_vk.metrics import nmse
    rng = np.random.default_rng(64)
    w = _small_model(rng, "q8_0", True)
    cfg, spec = w.config, K.KiviSpec(*bits, recent)
    tokens = rng.integers(0, cfg.vocab, 32 + recent + 40)
    arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(tokens) + 4, cache="kivi", kivi=spec)
    forward = DeviceForward(w, arena, logits=True, row_threads=8)
    got, _ = _decode(forward, tokens)
    assert int(arena.memory.layer_words(0)[arena.layout.layers[0].k.state_word]) == \
        K.quantised_end(len(tokens), recent) >= 64
    ref = _KiviAsHeld(arena, KiviHook(*bits, recent))
    want = llama.token_nll(tokens, ref, model=dequantised_model(w))
    assert np.abs(got - want).max() <= NLL_GATE, np.abs(got - want).max()
    for layer, (k, v) in enumerate(ref.kv):  # what the device quantised, against the host's quantiser
        for held, host in zip(arena.read(layer), K.cache_rows(k, v, len(tokens), spec)):
            assert nmse(host, held) <= 1e-4
    forward.free()


@pytest.mark.parametrize("n_heads,window,pre_rope", [(1, (0, 0), False), (2, (0, 0), False), (1, (1, 4), False),
                                                    (1, (0, 0), True), (2, (1, 4), True)],
                         ids=["shared", "per-head", "window", "keys-before-rope", "keys-before-rope-window"])
def test_dict_cache_equals_the_forward_over_its_slots(n_heads, window, pre_rope, make_arena, activate):
    """Over a dict-coded cache (residual stages; a shared or a per-head dictionary; an exact
    window; keys coded before RoPE) the device forward codes each token's K/V rows on the device
    — the GPU encoder's one dispatch a stream, recorded in the token; keys before RoPE from the
    projection's unturned copy — and attends over the slots (and the window's binary16 rows,
    append_window): within the NLL gate of the forge's forward over the arena's own slots
    decoded (arena.read, keys turned; the window per query, as the forge certifies it); and
    those slots are the host codec's coding of the forge's K/V (turned back first where coded
    before RoPE; OMP near-ties aside: at most one vector in twenty). An artifact coded before
    another RoPE than the model's is refused."""
    from conftest import random_artifact
    from kvdict_vk import codec, runtime
    from kvdict_vk.dictionary import KvDictArtifact
    from kvdict_vk.window import ExactWindow
    rng = np.random.default_rng(66)
    w = _small_model(rng, "q8_0", True)
    cfg = w.config
    art = random_artifact(rng, cfg.head_dim, 64, [((4, 4), (4, 3))] * cfg.n_layers, n_heads=n_heads)
    rope = KeyRope(cfg.rope_theta, cfg.rope_dim) if pre_rope else None
    if pre_rope:  # another RoPE than the model's: refused before anything is allocated
        activate(KvDictArtifact(art.head_dim, art.n_atoms, art.sparsity, art.layers,
                                key_rope=KeyRope(cfg.rope_theta * 2, cfg.rope_dim)))
        other = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16)
        with pytest.raises(E.DictMismatchError, match="RoPE"):
            DeviceForward(w, other, logits=True, row_threads=8)
    activate(KvDictArtifact(art.head_dim, art.n_atoms, art.sparsity, art.layers, ExactWindow(*window), key_rope=rope))
    tokens = rng.integers(0, cfg.vocab, 12)
    arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16)
    assert arena.mode == "dict" and arena.layout.layers[0].windowed == any(window)
    forward = DeviceForward(w, arena, logits=True, row_threads=8)
    got, _ = _decode(forward, tokens)
    ref = CacheAsHeld(arena, "dict")
    ref.exact_sink, ref.exact_recent = window
    want = llama.token_nll(tokens, ref, model=dequantised_model(w))
    assert np.abs(got - want).max() <= NLL_GATE, np.abs(got - want).max()
    same = []
    for layer, kv in enumerate(ref.kv):
        for rows, held, is_k in zip(kv, arena.read(layer), (True, False)):
            d = runtime.clone_layer_dict(layer, is_k)
            host = codec.held_heads(rows, d, rope if is_k else None, 0, np.float32)
            tol = np.full(host.shape[:2] + (1,), 1e-5)
            if any(window):  # the window's tokens are the forge's rows in binary16, to a binary16 step
                exact = ExactWindow(*window).exact(len(tokens))
                host[:, exact] = rows[:, exact].astype(np.float16)
                tol[:, exact] = 2.0 ** -10
            same += list(np.all(np.abs(host - held) <= tol * (1 + np.abs(host)), axis=-1).reshape(-1))
    assert len(same) == 2 * cfg.n_layers * cfg.n_kv_heads * len(tokens) and np.mean(same) >= 0.95, np.mean(same)
    forward.free()


class _KiviAsHeld(CacheAsHeld):
    """Attention over a KIVI arena's values as held, with ``hook``'s exact windows per query."""

    def __init__(self, arena, hook):
        super().__init__(arena, "kivi")
        self.exact_group, self.exact_recent, self.exact_sink = hook.exact_group, hook.exact_recent, hook.exact_sink

    def __call__(self, layer, k, v):
        self.kv.append((k, v))
        return self.arena.read(layer)


@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0"])
def test_smollm2_first_tokens_equal_the_forge_forward(cache, make_arena):
    """The real model (its GGUF's Q4_1 and Q8_0 blocks as stored) over the demo's text."""
    from kvdict_vk.forge import texts, tokenizer
    from kvdict_vk.forge.gguf_model import load_model
    w = _smollm2()
    cfg = w.config
    tokens = np.asarray(tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[:6])
    arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16, cache=cache)
    got, _ = _decode(DeviceForward(w, arena, logits=True), tokens)
    ref = CacheAsHeld(arena, cache)
    want = llama.token_nll(tokens, ref, model=load_model())
    assert np.abs(got - want).max() <= NLL_GATE, np.abs(got - want).max()
    ref.check_rows()


@functools.lru_cache(maxsize=1)
def _smollm2():
    from kvdict_vk.vk.forward import from_gguf
    return from_gguf()


def test_weight_repacking_is_the_gguf_dequantisation():
    """The device formats hold GGUF's numbers: every tensor of layer 0 and the embedding
    dequantise to exactly what the forge's loader (gguf-py) makes of them."""
    from kvdict_vk.forge.gguf_model import load_model
    w, ref = _smollm2(), load_model()
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(dequantised(getattr(w.layers[0], name)), getattr(ref.layers[0], name))
    np.testing.assert_array_equal(dequantised(w.tok_embd), ref.tok_embd)
    assert {w.layers[0].wq.fmt, w.tok_embd.fmt} == {"q4_1", "q8_0"}
    assert w.layers[0].wq.words.shape[1] == w.config.hidden // 32 * BLOCK_WORDS["q4_1"]


def test_bad_input_and_refusals(make_arena, activate):
    """A token outside the vocabulary, a full sequence: typed errors before anything is
    written (the counts stay, the next run is still right). An arena of other shapes, a
    bad row_threads, a device-coded step of two sequences: refused before anything is allocated. Logits not
    asked for, a freed forward: ArenaError."""
    from conftest import random_artifact
    rng = np.random.default_rng(61)
    w = _small_model(rng, "q4_1", True)
    cfg = w.config
    arena = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 3, cache="f16")
    forward = DeviceForward(w, arena, logits=True)
    for bad in (-1, cfg.vocab, 2.0, True, np.int64(cfg.vocab)):
        with pytest.raises(E.ShapeError):
            forward.run(bad)
    assert arena.n_tokens(0) == 0
    tokens = [5, 7, 11]
    got, _ = _decode(forward, tokens)
    with pytest.raises(E.ArenaError, match="full"):
        forward.run(3)
    assert arena.n_tokens(0) == arena.n_tokens(1) == 3
    want = llama.token_nll(np.array(tokens), CacheAsHeld(arena, "f16"), model=dequantised_model(w))
    assert np.abs(got - want).max() <= NLL_GATE
    forward.free()
    with pytest.raises(E.ArenaError):
        forward.run(1)
    other = make_arena(cfg.n_layers, cfg.n_kv_heads, 64, 8, cache="f16")
    with pytest.raises(E.ShapeError):
        DeviceForward(w, other)
    with pytest.raises(E.ShapeError):
        DeviceForward(w, make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, cache="f16"), row_threads=3)
    for lone in (1, 64):  # a row of one invocation, a row wider than any subgroup: no shuffles to add by
        with pytest.raises(E.DispatchError, match="shuffles"):
            DeviceForward(w, make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, cache="f16"), row_threads=lone,
                          subgroups=True)
    with pytest.raises(E.ArenaError, match="logits"):
        DeviceForward(w, make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, cache="f16")).logits()
    activate(random_artifact(rng, cfg.head_dim, 64, [((4, 4), (4, 4))] * cfg.n_layers, n_heads=cfg.n_kv_heads))
    coded = make_arena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, seqs=2)
    with pytest.raises(E.ArenaError, match="one sequence"):  # rows coded on the device: one sequence's
        coded.record_step(cfg.n_heads, batch=2, record=False)


def test_matrix_shapes_are_checked():
    with pytest.raises(E.ShapeError):
        Matrix("q4_1", 2, 48, np.zeros((2, 10), np.uint32))
    with pytest.raises(E.ShapeError):
        Matrix("q4_1", 2, 64, np.zeros((2, 9), np.uint32))
    with pytest.raises(E.ShapeError):
        Matrix("q5_0", 2, 64, np.zeros((2, 10), np.uint32))


@pytest.mark.parametrize("case", ["ties", "nan", "all_neg_inf", "last", "short"])
def test_argmax_kernel_is_numpys(case, vk_device):
    """fwd_argmax's two stages: the first index of the largest value (numpy.argmax), NaN
    never winning, across part boundaries and with fewer values than parts."""
    from kvdict_vk.vk.device import kp
    from kvdict_vk.vk.kernels import Buffer, barrier, pipeline, run
    rng = np.random.default_rng(62)
    n = 5 if case == "short" else 1000
    x = rng.standard_normal(n).astype(np.float32)
    if case == "ties":
        x[[17, 400, 999]] = 9.0
    elif case == "nan":
        x[[3, 500]] = np.nan
        x[700] = 7.0
    elif case == "all_neg_inf":
        x[:] = -np.inf
    elif case == "last":
        x[-1] = 50.0
    want = int(np.nanargmax(x)) if case == "nan" else int(np.argmax(x))
    parts = 7
    xs = Buffer(vk_device, n + 3, "device", "logits", np.concatenate([np.zeros(3, np.float32), x]))
    partial = Buffer(vk_device, 2 * parts, "device", "partials")
    state = Buffer(vk_device, 4, "device", "state")
    try:
        stage0 = pipeline(vk_device, "fwd_argmax", [xs, partial, state], max_items=3 * 64)
        stage1 = pipeline(vk_device, "fwd_argmax", [xs, partial, state])
        push = dict(x_word=3, n=n, out_word=2, parts=parts)
        run(vk_device, kp.OpTensorSyncDevice([xs.tensor]), stage0.op(**push, stage=0), barrier(partial),
            stage1.op(**push, stage=1), kp.OpTensorSyncLocal([state.tensor]))
        assert int(state.host_words()[2]) == want
    finally:
        for b in (xs, partial, state):
            b.destroy()
