"""Threads flip the switch while others read: every read matches one snapshot, nothing
raises unexpectedly, and it all finishes in bounded time."""
from __future__ import annotations

import threading
import time

import numpy as np

from kvdict_vk import artifact as A
from kvdict_vk import codec, runtime

from helpers import toy_artifact, toy_cert

SECONDS = 3.0


def test_switch_flipping_never_tears_reads(tmp_path):
    rng = np.random.default_rng(11)
    arts = [toy_artifact(rng, n_layers=2, n_atoms=32, head_dim=8, s=s, passthrough=())
            for s in (2, 3)]
    paths = []
    for i, art in enumerate(arts):
        p = tmp_path / f"a{i}.q42art"
        A.write_artifact(p, art, toy_cert(art))
        paths.append(p)
    # What each artifact's layer-0 K reconstruction must be, computed up front.
    x = rng.standard_normal((2, 8)).astype(np.float32)
    expected = [codec.roundtrip(x, a.layers[0][0]) for a in arts]

    stop = threading.Event()
    failures: list[str] = []
    counts = {"writes": 0, "reads": 0, "reconstructs": 0}

    def writer(seed):
        r = np.random.default_rng(seed)
        while not stop.is_set():
            op = r.integers(6)
            try:
                if op == 0:
                    runtime.activate(paths[r.integers(2)])
                elif op == 1:
                    runtime.deactivate()
                elif op == 2:
                    runtime.clear()
                elif op == 3:
                    runtime.install(arts[r.integers(2)])
                elif op == 4:
                    runtime.enable()
                else:
                    runtime.disable()
                counts["writes"] += 1
            except Exception as e:  # noqa: BLE001 — any exception is a failure here
                failures.append(f"writer: {e!r}")

    def reader():
        while not stop.is_set():
            try:
                snap = runtime.snapshot()
                # A snapshot's own fields are always mutually consistent.
                if snap.active != (snap.enabled and snap.artifact is not None):
                    failures.append("snapshot.active inconsistent")
                meta = runtime.installed_meta()
                if meta is not None and meta not in ((2, 8), (3, 8)):
                    failures.append(f"installed_meta {meta}")
                flat = runtime.atoms_flat()
                if flat is not None and flat[0].size != 2 * 2 * 32 * 8:
                    failures.append("atoms_flat size")
                runtime.dict_active()
                counts["reads"] += 1

                proj = x.reshape(-1).copy()
                did = runtime.reconstruct_kv(0, True, proj, 2)
                got = proj.reshape(2, 8)
                if did:
                    if not any(np.array_equal(got, e) for e in expected):
                        failures.append("reconstruct_kv result matches no snapshot")
                elif not np.array_equal(got, x):
                    failures.append("no-op reconstruct_kv modified its input")
                counts["reconstructs"] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(f"reader: {e!r}")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(SECONDS)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    runtime.deactivate()
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert time.perf_counter() - t0 < SECONDS + 30
    assert not failures, failures[:5]
    assert counts["writes"] > 50 and counts["reconstructs"] > 50, counts
