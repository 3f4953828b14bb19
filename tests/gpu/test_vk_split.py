"""An arena split over two logical Vulkan devices (kvdict_vk.vk.split; on lavapipe: two Kompute
managers of one physical device), by layers and by KV heads: every read, attention and step
equals one device's arena over the same cache (f16 rows, and dict slots appended as codes — the
exact path) to NMSE ≤ 1e-9, each device holds only its part (its dictionaries cut to its KV
heads), guard words stay intact, and what a split cannot take is refused with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_artifact
from kvdict_vk import codec
from kvdict_vk import errors as E
from kvdict_vk.metrics import nmse
from kvdict_vk.vk import KvArena
from kvdict_vk.vk.split import SplitArena, artifact_part, open_devices, ranges

N_LAYERS, N_KV, HD, N_CTX, GROUP = 3, 3, 64, 160, 2


_DEVICES: dict = {}


@pytest.fixture
def devices(vk_device):
    """The session's device and one more logical device of it (made once: a Kompute manager)."""
    if vk_device not in _DEVICES:
        _DEVICES[vk_device] = open_devices(vk_device, 2)
    return _DEVICES[vk_device]


def _pair(devices, split, **kw):
    """(one device's arena, the split one), guarded, over the same cache."""
    one = KvArena(N_LAYERS, N_KV, HD, N_CTX, device=devices[0], guard_words=16, **kw)
    two = SplitArena(N_LAYERS, N_KV, HD, N_CTX, devices, split=split, guard_words=16, **kw)
    return one, two


def _guards_intact(arena: KvArena) -> None:
    assert arena.layout.guard_breaches(arena.layer_words) == []


def _check(one, two, rng, sizes, coded_by=None):
    """Append ``sizes`` tokens (rows, or with ``coded_by`` (K, V) StreamDicts their slots) to
    every layer of both, then compare reads, attention and a step layer by layer."""
    for layer in range(N_LAYERS):
        for n in sizes:
            k, v = (rng.standard_normal((N_KV, n, HD)).astype(np.float32) for _ in "kv")
            if coded_by is None:
                assert one.append(layer, k, v) == two.append(layer, k, v)
            else:
                ks, vs = (codec.encode_heads(x, d) for x, d in zip((k, v), coded_by[layer]))
                assert one.append_codes(layer, ks, vs) == two.append_codes(layer, ks, vs)
        n = sum(sizes)
        assert two.n_tokens(layer) == n
        for a, b in zip(one.read(layer), two.read(layer)):
            np.testing.assert_array_equal(a, b)  # the same words, the same reconstruct
        q = rng.standard_normal((N_KV * GROUP, HD)).astype(np.float32)
        for used in (1, n // 2, n):
            assert nmse(one.attend(layer, q, used), two.attend(layer, q, used)) <= 1e-9
        if coded_by is None:  # a step: its rows appended on each device, attended over
            k, v = (rng.standard_normal((N_KV, 1, HD)).astype(np.float32) for _ in "kv")
            assert nmse(one.step(layer, k, v, q), two.step(layer, k, v, q)) <= 1e-9


@pytest.mark.parametrize("split", ["layer", "head"])
@pytest.mark.parametrize("cache", ["f16", "f32", "q8_0", "kivi"])
def test_uncoded_split_equals_one_device(devices, split, cache):
    one, two = _pair(devices, split, cache=cache)
    with one, two:
        _check(one, two, np.random.default_rng(1), (1, 40, 1, 70))
        for p in two.parts:
            _guards_intact(p.arena)
        assert [p.arena.device for p in two.parts] == devices
        mem = two.memory()
        if split == "layer":
            assert [m["layers"] for m in mem] == [[0, 1], [1, 3]] and all(m["kv_heads"] == [0, 3] for m in mem)
        else:
            assert [m["kv_heads"] for m in mem] == [[0, 1], [1, 3]] and all(m["layers"] == [0, 3] for m in mem)
        # each part pays its own alignment and state words, a few hundred words a layer, no more
        assert sum(m["arena_bytes"] for m in mem) <= one.layout.total_bytes + 2 * 256 * 4 * N_LAYERS * 2


@pytest.mark.parametrize("split", ["layer", "head"])
@pytest.mark.parametrize("heads", [1, N_KV], ids=["shared", "per-head"])
def test_dict_split_equals_one_device(devices, activate, split, heads):
    rng = np.random.default_rng(heads)
    art = random_artifact(rng, HD, 64, [((4, 6), (4, 4))] * N_LAYERS, n_heads=heads, f16_atoms=True)
    activate(art)
    one, two = _pair(devices, split, encoder="cpu")
    with one, two:
        assert one.mode == "dict" and all(p.arena.mode == "dict" for p in two.parts)
        for p in two.parts:  # each device holds its part: its layers, its heads' dictionaries
            for i in range(*p.layers):
                d = p.arena.stream_dict(i - p.layers[0], "k")
                want = art.layers[i][0].atoms if heads == 1 else art.layers[i][0].atoms[p.heads[0]:p.heads[1]]
                np.testing.assert_array_equal(d.atoms, want)
        _check(one, two, rng, (1, 50, 3), coded_by=[pair for pair in art.layers])
        for p in two.parts:
            _guards_intact(p.arena)


def test_refusals_change_nothing(devices, activate):
    one, two = _pair(devices, "head", cache="f16")
    rng = np.random.default_rng(3)
    with one, two:
        k = rng.standard_normal((N_KV, 5, HD)).astype(np.float32)
        two.append(0, k, k)
        before = two.read(0)
        with pytest.raises(E.ShapeError):
            two.append(0, k[:2], k[:2])  # not every KV head
        with pytest.raises(E.ShapeError):
            two.attend(0, np.zeros((N_KV + 1, HD), np.float32), 5)
        with pytest.raises(E.ArenaError, match="exceed n_ctx"):
            two.append(0, *(np.zeros((N_KV, N_CTX, HD), np.float32),) * 2)
        with pytest.raises(E.LayerIndexError):
            two.read(N_LAYERS)
        assert two.n_tokens(0) == 5
        for a, b in zip(before, two.read(0)):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(E.ArenaError, match="distinct"):
        SplitArena(N_LAYERS, N_KV, HD, N_CTX, [devices[0], devices[0]])
    with pytest.raises(E.ArenaError, match="split must be"):
        SplitArena(N_LAYERS, N_KV, HD, N_CTX, devices, split="rows")
    with pytest.raises(E.ArenaError, match="non-empty"):
        SplitArena(1, N_KV, HD, N_CTX, devices, split="layer")
    art = random_artifact(rng, HD, 32, [(2, 2)] * N_LAYERS)
    activate(art)
    with pytest.raises(E.ArenaError, match="cut from the installed"):  # fail-closed: not any artifact
        KvArena(N_LAYERS, N_KV, HD, N_CTX, device=devices[0], dictionary_part=art)
    other = random_artifact(rng, HD, 32, [(2, 2)] * N_LAYERS)
    with pytest.raises(E.ArenaError, match="cut from the installed"):
        KvArena(1, N_KV, HD, N_CTX, device=devices[0], dictionary_part=artifact_part(other, (0, 1)))


def test_ranges_cover_and_balance():
    assert ranges(30, 4) == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(E.ArenaError):
        ranges(2, 3)


def test_a_submission_lets_other_threads_run(vk_device):
    """kp's Sequence.eval releases the GIL while it submits and waits (scripts/kp_patch.py item
    6): a Python thread spinning beside a long submission gets most of its time. Held, it would
    get at most one switch interval before the eval starts. The submission: reads of a scratch
    buffer (l2_flush, a barrier after each), repeated until it takes ≥ 0.1 s on this device."""
    import sys
    import threading
    import time
    from kvdict_vk.vk.kernels import Buffer, barrier, pipeline
    from kvdict_vk.vk.submit import Recording
    words = 1 << 22
    src, sink = Buffer(vk_device, words, "storage", "read source"), Buffer(vk_device, 4, "storage", "read sink")
    flush = pipeline(vk_device, "l2_flush", [src, sink], max_items=words // 4)
    reps, rec = 1, None
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1
    try:
        while True:  # the submission made long enough to tell
            rec = Recording(vk_device, [op for _ in range(reps) for op in (flush.op(n_words=words), barrier(sink))],
                            what="repeated reads")
            rec.run()
            t0 = time.perf_counter()
            rec.run()
            if time.perf_counter() - t0 >= 0.1 or reps >= 1 << 14:
                break
            reps *= max(2, int(0.15 / max(time.perf_counter() - t0, 1e-4)))
            rec.free()
        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            time.sleep(0.05)
            c0, t0 = count[0], time.perf_counter()
            time.sleep(0.05)  # the spinner's pace alone
            rate = (count[0] - c0) / (time.perf_counter() - t0)
            c0, t0 = count[0], time.perf_counter()
            rec.run()
            during, dt = count[0] - c0, time.perf_counter() - t0
        finally:
            stop[0] = True
            spinner.join()
    finally:
        if rec is not None:
            rec.free()
        sink.destroy()
        src.destroy()
    assert dt > 4 * sys.getswitchinterval(), f"the submission ({dt:.3f} s) is too short to tell"
    assert during / rate > 0.3 * dt, (during, rate, dt)


@pytest.mark.parametrize("split", ["layer", "head"])
@pytest.mark.parametrize("cache", ["f16", "dict"])
def test_recorded_step_over_the_split(devices, activate, split, cache):
    """SplitArena.record_step: each device's recorded step over its layers and KV heads, run at
    once, equals one device's recorded step token by token (per-head dictionaries: each head's
    token coded alone either way), and a full sequence is refused before any device runs."""
    rng = np.random.default_rng(7)
    kw = dict(cache="f16")
    if cache == "dict":
        activate(random_artifact(rng, HD, 64, [((4, 6), (4, 4))] * N_LAYERS, n_heads=N_KV, f16_atoms=True))
        kw = dict(encoder="cpu")
    one, two = _pair(devices, split, **kw)
    with one, two:
        layers = [0, 2]
        for layer in layers:
            k = rng.standard_normal((N_KV, 20, HD)).astype(np.float32)
            one.append(layer, k, k)
            two.append(layer, k, k)
        s1, s2 = one.record_step(N_KV * GROUP, layers), two.record_step(N_KV * GROUP, layers)
        for _ in range(3):
            k, v = (rng.standard_normal((len(layers), 1, N_KV, HD)).astype(np.float32) for _ in "kv")
            q = rng.standard_normal((len(layers), 1, N_KV * GROUP, HD)).astype(np.float32)
            assert nmse(s1.run(k, v, q), s2.run(k, v, q)) <= 1e-9
        assert [two.n_tokens(i) for i in range(N_LAYERS)] == [23, 0, 23]
        for layer in layers:
            for a, b in zip(one.read(layer), two.read(layer)):
                np.testing.assert_array_equal(a, b)
        with pytest.raises(E.ShapeError):
            s2.run(k[:1], v[:1], q[:1])
        fill = np.zeros((N_KV, N_CTX - 23, HD), np.float32)
        two.append(0, fill, fill)  # layer 0 full: the step refuses before layer 2's device runs
        with pytest.raises(E.ArenaError, match="exceed n_ctx"):
            s2.run(k, v, q)
        assert [two.n_tokens(i) for i in range(N_LAYERS)] == [N_CTX, 0, 23]
        s2.free()


def _model(rng, n_layers: int = 3, tied: bool = True):
    """A random model of 3 layers over N_KV KV heads × HD (6 query heads, hidden 96)."""
    from kvdict_vk.model_file import ModelConfig
    from kvdict_vk.vk.forward import random_weights
    cfg = ModelConfig("llama", n_layers, 96, N_KV * GROUP, N_KV, HD, 160, 10000.0, HD, 1e-5, 300, 64, tied)
    return random_weights(cfg, rng, "q8_0")


@pytest.mark.parametrize("cache", ["f16", "q8_0", "kivi", "dict"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_device_forward_over_a_layer_split(devices, activate, cache, tied):
    """SplitForward: each device runs its layers (DeviceForward(layers=)), the residual stream
    handed on through the host; every token and every logit equals one device's forward over the
    same model and cache (dict: per-head dictionaries, the GPU encoder), the arenas hold the same
    values, and each device holds only its layers' weights (the embedding on the first, the
    norm and LM head on the last)."""
    from kvdict_vk.vk.forward import DeviceForward
    rng = np.random.default_rng(11)
    w = _model(rng, tied=tied)
    with _forwards(devices, activate, "layer", cache, w, rng) as (one, two, ref, split):
        first, last = split.parts
        assert (first.layers, last.layers) == ((0, 1), (1, 3)) and first.first and last.last
        assert first.weight_bytes + last.weight_bytes >= ref.weight_bytes
        assert max(split.weight_bytes) < ref.weight_bytes
        with pytest.raises(E.ShapeError):
            split.run(w.config.vocab)  # refused before any part runs
        with pytest.raises(E.ArenaError, match="SplitForward drives it"):
            first.run(0)
        with pytest.raises(E.ShapeError, match="residual"):
            last.run_part(0)
        assert all(two.n_tokens(i) == split.tokens for i in range(N_LAYERS))
        assert isinstance(ref, DeviceForward)
        fill = np.zeros((N_KV, N_CTX - split.tokens, HD), np.float32)
        two.append(2, fill, fill)  # the last layer full: refused before the first part runs
        with pytest.raises(E.ArenaError, match="layer 2: .* exceed n_ctx"):
            split.run(0)
        assert [two.n_tokens(i) for i in range(N_LAYERS)] == [split.tokens, split.tokens, N_CTX]


@pytest.mark.parametrize("cache", ["f16", "q8_0", "dict"])
def test_device_forward_over_a_head_split(devices, activate, cache):
    """SplitForward over KV heads: each device computes Q, K and V of its heads and attends over
    them (DeviceForward(heads=)), every layer's outputs gathered on the host before each device's
    O projection; tokens and logits equal one device's forward (NMSE ≤ 1e-9: each device plans
    its attention for its own heads), the arenas hold the same values, and a token takes a
    submission a layer and a device."""
    rng = np.random.default_rng(12)
    w = _model(rng, tied=False)
    with _forwards(devices, activate, "head", cache, w, rng) as (one, two, ref, split):
        assert [f.heads for f in split.parts] == [(0, 1), (1, 3)] and all(f.split_heads for f in split.parts)
        assert [f.segments for f in split.parts] == [N_LAYERS + 1] * 2
        with pytest.raises(E.ArenaError, match="SplitForward drives it"):
            split.parts[0].run(0)
        with pytest.raises(E.ArenaError, match="segment at a time"):
            split.parts[0].run_part(0)
        with pytest.raises(E.ShapeError, match="not both"):
            from kvdict_vk.vk.forward import DeviceForward
            DeviceForward(w, two.parts[0].arena, layers=(0, 1), heads=(0, 1))


class _forwards:
    """(one device's arena, the split one, a DeviceForward over the first, a SplitForward over the
    second), both fed the same 9 tokens and checked token by token (greedy picks equal, logits
    within NMSE 1e-9), their arenas compared after; all freed on exit."""

    def __init__(self, devices, activate, split, cache, w, rng):
        self.args = devices, activate, split, cache, w, rng

    def __enter__(self):
        from kvdict_vk.vk.forward import DeviceForward, SplitForward
        devices, activate, split, cache, w, rng = self.args
        kw = dict(cache=cache)
        if cache == "dict":
            activate(random_artifact(rng, HD, 64, [((4, 4), (4, 3))] * N_LAYERS, n_heads=N_KV, f16_atoms=True))
            kw = {}
        self.one, self.two = _pair(devices, split, **kw)
        self.ref = DeviceForward(w, self.one, logits=True, row_threads=8)
        self.split = SplitForward(w, self.two, logits=True, row_threads=8)
        tokens = rng.integers(0, w.config.vocab, 9)
        for tok in tokens:
            assert self.ref.run(int(tok)) == self.split.run(int(tok))
            assert nmse(self.ref.logits(), self.split.logits()) <= 1e-9
        self.split.tokens = len(tokens)
        for layer in range(N_LAYERS):
            assert self.two.n_tokens(layer) == len(tokens)
            for a, b in zip(self.one.read(layer), self.two.read(layer)):
                if split == "layer":  # the same kernels over the same numbers
                    np.testing.assert_array_equal(a, b)
                assert nmse(a, b) <= 1e-9
        return self.one, self.two, self.ref, self.split

    def __exit__(self, *exc):
        self.ref.free()
        self.split.free()
        self.one.free()
        self.two.free()
