"""Arenas under a flipping switch: an arena reads the runtime once at creation, so appends,
reads and attention in one thread are unaffected by activate/deactivate/clear/install in
others; every arena created meanwhile has the layout of one consistent snapshot."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvdict_vk import artifact as A
from kvdict_vk import codec, runtime
from kvdict_vk.dictionary import KvDictArtifact, StreamDict

from conftest import nmse
from helpers import toy_cert

pytestmark = pytest.mark.gpu


def _art(rng, s):
    d = StreamDict(rng.standard_normal((2, 16, 8)), rng.standard_normal((2, 8)), None, s)
    return KvDictArtifact(8, 16, s, [(d, d), (None, d)])


def test_arena_work_while_switch_flips(vk_device, tmp_path):
    from kvdict_vk.vk import KvArena
    rng = np.random.default_rng(3)
    arts = [_art(rng, 2), _art(rng, 3)]
    paths = []
    for i, a in enumerate(arts):
        p = tmp_path / f"a{i}.q42art"
        A.write_artifact(p, a, toy_cert(a))
        paths.append(p)
    runtime.enable(arts[0])
    arena = KvArena(2, 2, 8, 256)
    runtime.deactivate()
    stop = threading.Event()
    errors: list[str] = []

    def flipper():
        r = np.random.default_rng(1)
        while not stop.is_set():
            try:
                [lambda: runtime.activate(paths[r.integers(2)]), runtime.deactivate, runtime.clear,
                 lambda: runtime.install(arts[r.integers(2)]), runtime.enable, runtime.disable][r.integers(6)]()
            except Exception as e:  # noqa: BLE001
                errors.append(f"flipper: {e!r}")

    def creator():
        while not stop.is_set():
            try:
                snap = runtime.snapshot()
                with KvArena(2, 2, 8, 16) as a:
                    # A consistent layout: f32, or dict with the sparsity of one artifact.
                    assert a.mode in ("f32", "dict")
                    if a.mode == "dict":
                        assert a.layout.sparsity in (2, 3)
                    del snap
            except Exception as e:  # noqa: BLE001
                errors.append(f"creator: {e!r}")

    threads = [threading.Thread(target=flipper), threading.Thread(target=creator)]
    for t in threads:
        t.start()
    try:
        x = rng.standard_normal((2, 40, 8)).astype(np.float32)
        d = arts[0].layers[0][0]
        t_end = time.perf_counter() + 3
        rounds = 0
        while time.perf_counter() < t_end and arena.n_tokens(0) + 40 <= 256:
            n0 = arena.n_tokens(0)
            arena.append(0, x, x)
            k, _ = arena.read(0, n0, n0 + 40)
            assert nmse(codec.decode_heads(codec.encode_heads(x, d), d), k) <= 1e-12
            q = rng.standard_normal((4, 8)).astype(np.float32)
            arena.attend(0, q, n0 + 40)
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        arena.free()
        runtime.deactivate()
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    assert rounds >= 3
