"""An arena split over two torch.distributed ranks on gloo (kvdict_vk.vk.ranks; issue 53): two
processes, each with its own lavapipe device and its part of the arena, make the same calls
(tests/gpu/rank_worker.py's script) — and every call hands back on both ranks what one device's
arena does over the same cache, to NMSE ≤ 1e-9 (reads bit for bit), for both splits over f16
rows and per-head dictionary slots (the exact path); refusals are raised on every rank with
nothing changed, each rank holds only its part, its guard words intact and its validation
layer log empty."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import VALIDATION, device_required, layer_settings, random_artifact
from kvdict_vk.metrics import nmse
from kvdict_vk.vk import KvArena

import rank_worker as W

if device_required():
    import torch  # noqa: F401 — `make test` installs the distributed extra: its absence fails the run
else:
    pytest.importorskip("torch")

WORLD = 2
CASES = {f"{split}-{cache}": (split, cache) for split in ("layer", "head") for cache in ("f16", "kivi", "dict")}
FORWARDS = {f"forward-{split}-{cache}": (split, cache) for split in ("layer", "head") for cache in ("f16", "dict")}


def _artifact(seed: int):
    return random_artifact(np.random.default_rng(seed), W.HD, 64, [((4, 6), (4, 4))] * W.N_LAYERS,
                           n_heads=W.N_KV, f16_atoms=True)


def _arena_kw(cache: str) -> dict:
    """A KIVI cache with a window short enough that the script's tokens leave it (groups quantised)."""
    from kvdict_vk.kivi import KiviSpec
    return {"kivi": KiviSpec(4, 4, 16)} if cache == "kivi" else {}


@pytest.fixture(scope="module")
def ranks(vk_probe, tmp_path_factory):
    """Both ranks' results for every case (one pair of processes runs them all), and each
    rank's validation log."""
    tmp = tmp_path_factory.mktemp("ranks")
    cases = {name: dict(split=split, cache=cache, seed=i, device=vk_probe.device.name, forward=name in FORWARDS,
                        artifact=_artifact(i) if cache == "dict" else None, arena_kw=_arena_kw(cache))
             for i, (name, (split, cache)) in enumerate({**CASES, **FORWARDS}.items())}
    (tmp / "cases.pkl").write_bytes(pickle.dumps(cases))
    procs, logs = [], []
    for rank in range(WORLD):
        env = dict(os.environ)
        if VALIDATION:  # the rank's own log: a second instance would truncate the session's
            d = tmp / f"vvl{rank}"
            d.mkdir()
            logs.append(d / "validation.log")
            (d / "vk_layer_settings.txt").write_text(layer_settings(logs[-1]))
            env["VK_LAYER_SETTINGS_PATH"] = str(d)
        procs.append(subprocess.Popen(
            [sys.executable, W.__file__, str(rank), str(WORLD), str(tmp / "init"), str(tmp / "cases.pkl"),
             str(tmp / f"out{rank}.pkl")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{text[-4000:]}"
    return dict(cases=cases, results=[pickle.loads((tmp / f"out{r}.pkl").read_bytes()) for r in range(WORLD)],
                logs=[log.read_text() if log.exists() else "" for log in logs])


def _same(a, b) -> None:
    if isinstance(a, np.ndarray):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert nmse(a, b) <= 1e-9
    else:
        assert a == b


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_equal_one_device(ranks, vk_device, activate, name):
    case = ranks["cases"][name]
    kw = dict(cache=case["cache"], **case["arena_kw"])
    if case["artifact"] is not None:
        activate(case["artifact"])
        kw = dict(encoder="cpu")
    with KvArena(W.N_LAYERS, W.N_KV, W.HD, W.N_CTX, device=vk_device, guard_words=16, **kw) as one:
        want = W.script(one, case["seed"], None if case["artifact"] is None else case["artifact"].layers)
        if case["cache"] == "kivi":  # the script's tokens left the window: groups were quantised
            assert int(one.memory.layer_words(0)[one.layout.layers[0].k.state_word]) >= 32
    assert "accepted" not in want[-6:-3] and want[-6:-3] == ["ShapeError", "ShapeError", "ArenaError"]
    for rank, res in enumerate(ranks["results"]):
        got = res[name]["calls"]
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(want, got)):
            try:
                _same(a, b)
            except AssertionError as exc:
                raise AssertionError(f"rank {rank}, call {i}: {exc}") from None
        assert res[name]["guard_breaches"] == []


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_part(ranks, name):
    split = CASES[name][0]
    parts = [r[name] for r in ranks["results"]]
    if split == "layer":
        assert [p["layers"] for p in parts] == [(0, 1), (1, 3)] and all(p["heads"] == (0, W.N_KV) for p in parts)
    else:
        assert [p["heads"] for p in parts] == [(0, 1), (1, 3)] and all(p["layers"] == (0, W.N_LAYERS) for p in parts)
    mem = parts[0]["memory"]  # every rank's part, as each rank sees it
    assert mem == parts[1]["memory"] and [m["layers"] for m in mem] == [list(p["layers"]) for p in parts]
    assert all(p["exchange_s"] > 0 for p in parts)


@pytest.mark.parametrize("name", list(FORWARDS))
def test_forward_over_ranks_equals_one_device(ranks, vk_device, activate, name):
    """SplitForward over the ranks: by layers each rank runs its layers, the residual stream sent
    from rank to rank; by KV heads each rank attends over its heads, every layer's outputs
    all-gathered. Every rank hands back one device's greedy tokens, the ranks with the last
    layers its logits (NMSE ≤ 1e-9); by layers each rank holds only its layers' weights."""
    from kvdict_vk.vk.forward import DeviceForward
    case = ranks["cases"][name]
    kw = dict(cache=case["cache"])
    if case["artifact"] is not None:
        activate(case["artifact"])
        kw = {}
    with KvArena(W.N_LAYERS, W.N_KV, W.HD, W.N_CTX, device=vk_device, **kw) as one:
        with DeviceForward(W.model(case["seed"]), one, logits=True, row_threads=8) as fw:
            want, whole = W.decode(fw, case["seed"]), fw.weight_bytes
    first, last = (r[name]["calls"] for r in ranks["results"])
    assert first[0:-1:2] == last[0:-1:2] == want[0::2]  # the tokens, on every rank
    for a, b in zip(last[1:-1:2], want[1::2]):
        assert nmse(a, b) <= 1e-9
    if case["split"] == "layer":
        assert all(x is None for x in first[1:-1:2])  # the first rank has no LM head
        assert max(first[-1] + last[-1]) < whole <= first[-1][0] + last[-1][0]
    else:  # every rank has the whole layer but its heads' Q, K and V
        for a, b in zip(first[1:-1:2], want[1::2]):
            assert nmse(a, b) <= 1e-9
        assert max(first[-1] + last[-1]) < whole


def test_a_refusal_on_one_rank_is_every_ranks(ranks):
    assert [r["refused"] for r in ranks["results"]] == ["ArenaTooLargeError"] * WORLD


def test_validation_logs_empty(ranks):
    assert ranks["logs"] == [""] * len(ranks["logs"])


def test_without_a_process_group_refused():
    from kvdict_vk import errors as E
    from kvdict_vk.vk.ranks import RankArena
    with pytest.raises(E.DistributedError, match="process group"):
        RankArena(W.N_LAYERS, W.N_KV, W.HD, W.N_CTX)
