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
from kvdict_vk.metrics import nmse

from helpers import toy_cert

pytestmark = pytest.mark.gpu


def _art(rng, s):
    d = StreamDict(rng.standard_normal((2, 16, 8)), rng.standard_normal((2, 8)), None, s)
    return KvDictArtifact(8, 16, s, [(d, d), (None, d)])


ROUNDS = 6  # appends of 40 tokens into a 256-token arena
ARENAS_PER_MODE = 3  # arenas the creator must make in each mode while the switch flips
HANG = 300  # seconds: only a deadlock takes this long, however loaded the machine


def _switch_ops(paths, arts, rng):
    """The flipper's moves: every way the switch and the installed state change."""
    return [lambda: runtime.activate(paths[rng.integers(2)]), runtime.deactivate, runtime.clear,
            lambda: runtime.install(arts[rng.integers(2)], allow_uncertified=True), runtime.enable,
            runtime.disable]


def _wait_for(condition, what: str) -> None:
    """Block until ``condition()``; the bound catches a deadlock, never slowness."""
    give_up = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < give_up, f"no progress in {HANG} s: {what}"
        time.sleep(0.001)


def test_arena_work_while_switch_flips(vk_device, tmp_path):
    """A fixed amount of work, each piece interleaved with flips: every round of appends,
    reads and attention starts only after the switch has changed since the last one, and
    the creator makes arenas of both modes while it flips."""
    from kvdict_vk.vk import KvArena
    rng = np.random.default_rng(3)
    arts = [_art(rng, 2), _art(rng, 3)]
    paths = []
    for i, a in enumerate(arts):
        p = tmp_path / f"a{i}.q42art"
        A.write_artifact(p, a, toy_cert(a))
        paths.append(p)
    with runtime.enabled_with(arts[0], allow_uncertified=True):
        arena = KvArena(2, 2, 8, 256)
    runtime.deactivate()
    with KvArena(2, 2, 8, 16) as plain:
        uncoded = plain.mode  # the uncoded cache's row format ($KVDICT_VK_CACHE, f16 by default)
    stop = threading.Event()
    errors: list[str] = []
    created = {uncoded: 0, "dict": 0}

    def flipper():
        ops = _switch_ops(paths, arts, np.random.default_rng(1))
        r = np.random.default_rng(2)
        while not stop.is_set():
            try:
                ops[r.integers(len(ops))]()
            except Exception as e:  # noqa: BLE001
                errors.append(f"flipper: {e!r}")

    def creator():
        while not stop.is_set():
            try:
                with KvArena(2, 2, 8, 16) as a:
                    # A consistent layout: uncoded, or dict with the sparsity of one artifact.
                    assert a.mode in created
                    if a.mode == "dict":
                        assert a.layout.sparsity in (2, 3)
                    created[a.mode] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(f"creator: {e!r}")

    threads = [threading.Thread(target=flipper), threading.Thread(target=creator)]
    for t in threads:
        t.start()
    d = arts[0].layers[0][0]
    try:
        for r in range(ROUNDS):
            seen = runtime.snapshot().generation
            _wait_for(lambda: runtime.snapshot().generation != seen, "the switch never flipped")
            x = rng.standard_normal((2, 40, 8)).astype(np.float32)
            n0 = arena.n_tokens(0)
            assert arena.append(0, x, x) == n0 + 40
            k, v = arena.read(0, n0, n0 + 40)
            want = codec.decode_heads(codec.encode_heads(x, d), d)
            assert nmse(want, k) <= 1e-12 and nmse(want, v) <= 1e-12, f"round {r}"  # layer 0: K, V both d
            q = rng.standard_normal((4, 8)).astype(np.float32)
            assert np.isfinite(arena.attend(0, q, n0 + 40)).all()
        _wait_for(lambda: min(created.values()) >= ARENAS_PER_MODE or errors,
                  f"the creator made {created} arenas")
        assert arena.n_tokens(0) == ROUNDS * 40
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=HANG)
        arena.free()
        runtime.deactivate()
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
