"""Threads flip the switch while others read: every read matches one snapshot, nothing
raises unexpectedly, and nothing deadlocks. The work is a fixed amount — each writer makes
WRITES changes, each reader READS reads — and each side keeps going until the other has
done its share, so every read overlaps writes (and the readers must see them land)."""
from __future__ import annotations

import threading

import numpy as np

from kvdict_vk import artifact as A
from kvdict_vk import codec, runtime

from helpers import toy_artifact, toy_cert

WRITES = 300  # per writer
READS = 300  # per reader
HANG = 300  # seconds: only a deadlock takes this long, however loaded the machine


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

    n_writers, n_readers = 2, 3
    writes_done, reads_done = [0] * n_writers, [0] * n_readers
    generations_seen: set[int] = set()
    failures: list[str] = []

    def writers_done() -> bool:
        return min(writes_done) >= WRITES

    def readers_done() -> bool:
        return min(reads_done) >= READS

    def writer(i):
        r = np.random.default_rng(i)
        while not (writers_done() and readers_done()) and not failures:
            op = r.integers(6)
            try:
                if op == 0:
                    runtime.activate(paths[r.integers(2)])
                elif op == 1:
                    runtime.deactivate()
                elif op == 2:
                    runtime.clear()
                elif op == 3:
                    runtime.install(arts[r.integers(2)], allow_uncertified=True)
                elif op == 4:
                    runtime.enable()
                else:
                    runtime.disable()
                writes_done[i] += 1
            except Exception as e:  # noqa: BLE001 — any exception is a failure here
                failures.append(f"writer: {e!r}")

    def reader(i):
        while not (writers_done() and readers_done()) and not failures:
            try:
                snap = runtime.snapshot()
                generations_seen.add(snap.generation)
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

                proj = x.reshape(-1).copy()
                did = runtime.reconstruct_kv(0, True, proj, 2)
                got = proj.reshape(2, 8)
                if did:
                    if not any(np.array_equal(got, e) for e in expected):
                        failures.append("reconstruct_kv result matches no snapshot")
                elif not np.array_equal(got, x):
                    failures.append("no-op reconstruct_kv modified its input")
                reads_done[i] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(f"reader: {e!r}")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_writers)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(n_readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG)
    runtime.deactivate()
    assert not any(t.is_alive() for t in threads), f"a thread hung: writes {writes_done}, reads {reads_done}"
    assert not failures, failures[:5]
    assert min(writes_done) >= WRITES and min(reads_done) >= READS
    # The readers ran while the writers did: they saw many states, not one.
    assert len(generations_seen) > 1, generations_seen
