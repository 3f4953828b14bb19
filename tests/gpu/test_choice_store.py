"""The store of measured choices ($KVDICT_VK_TUNE_CACHE, kvdict_vk.vk.choice_store): the flash
kernels' launch shapes (attend_tune) and the encoder (encode_choice) kept across processes —
taken back only for the same key and the same candidates, several processes' choices kept side
by side, a damaged or unwritable store measured around, never raised. A new process is
simulated by emptying the in-process choices."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import GPU_FASTER, random_artifact
from kvdict_vk.vk.attend import tune as T
from kvdict_vk.vk import choice_store as S
from kvdict_vk.vk.encode import choice as C


@pytest.fixture
def tuner(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "WARM_S", 0.0)
    path = tmp_path / "sub" / "tune.json"
    monkeypatch.setenv(S.CACHE_ENV, str(path))
    return path


def _timer(times: dict, calls: list):
    def time_shape(shape):
        calls.append(shape)
        return times[shape]
    return time_shape


SHAPES = [T.Shape(256, 256), T.Shape(128, 512), T.Shape(128, 1024, 0, "wide_end")]
TIMES = {SHAPES[0]: 3e-5, SHAPES[1]: 2e-5, SHAPES[2]: 4e-5}


def test_a_choice_outlives_the_process(tuner, monkeypatch):
    calls = []
    assert T.choose(("dev", "drv", "spv", 1), 5000, SHAPES, _timer(TIMES, calls)) == SHAPES[1]
    assert len(calls) == T.ROUNDS * len(SHAPES)
    stored = json.loads(tuner.read_text())
    assert stored["version"] == S.STORE_VERSION and len(stored["choices"]) == 1
    monkeypatch.setattr(T, "_CHOICES", {})  # a new process
    assert T.choose(("dev", "drv", "spv", 1), 6000, SHAPES, _timer({}, calls)) == SHAPES[1]  # no timing
    assert len(calls) == T.ROUNDS * len(SHAPES) and len(T.measured()) == 1
    # another bucket, other candidates, another signature (a driver or SPIR-V change): measured
    T.choose(("dev", "drv", "spv", 1), 20000, SHAPES, _timer(TIMES, calls))
    T.choose(("dev", "drv", "spv", 1), 5000, SHAPES[:2], _timer(TIMES, calls))
    T.choose(("dev", "drv2", "spv", 1), 5000, SHAPES, _timer(TIMES, calls))
    assert len(calls) == T.ROUNDS * (3 * len(SHAPES) + 2)
    choices = json.loads(tuner.read_text())["choices"]
    assert len(choices) == 3  # kept side by side; the other candidates' choice replaced its key's
    assert len(choices[json.dumps([T.STORE_KIND, *T.signature(("dev", "drv", "spv", 1), 5000)])]["offered"]) == 2


def test_a_store_from_another_process_is_kept(tuner, monkeypatch):
    calls = []
    T.choose(("a",), 5000, SHAPES, _timer(TIMES, calls))
    monkeypatch.setattr(T, "_CHOICES", {})
    T.choose(("b",), 5000, SHAPES, _timer(TIMES, calls))
    assert len(json.loads(tuner.read_text())["choices"]) == 2


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "choices": {}}), "[]",
                                     b"\xff\xfe not text", "CHOICE"])
def test_a_damaged_store_is_measured_around_and_rewritten(tuner, content, caplog):
    calls = []
    key = ("dev", 1)
    unreadable = content != "CHOICE"  # said in the log; an unusable entry of a readable store is not
    if content == "CHOICE":  # a readable entry whose choice is not among its candidates
        sig = T.signature(key, 5000)
        content = json.dumps({"version": S.STORE_VERSION, "choices": {json.dumps([T.STORE_KIND, *sig]): {
            "offered": [[s.local, s.workgroups, s.heads, s.kernel] for s in SHAPES], "choice": [64, 8, 0, "x"]}}})
    tuner.parent.mkdir(parents=True)
    tuner.write_bytes(content if isinstance(content, bytes) else content.encode())
    with caplog.at_level("WARNING", logger=S.__name__):
        assert T.choose(key, 5000, SHAPES, _timer(TIMES, calls)) == SHAPES[1]
    assert len(calls) == T.ROUNDS * len(SHAPES)
    assert any("measuring again" in r.getMessage() for r in caplog.records) == unreadable
    stored = json.loads(tuner.read_text())
    assert stored["version"] == S.STORE_VERSION and len(stored["choices"]) == 1


def test_an_unwritable_store_leaves_the_choice_in_the_process(tuner, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(S.CACHE_ENV, str(blocker / "tune.json"))  # its parent is a file
    calls = []
    assert T.choose(("dev",), 5000, SHAPES, _timer(TIMES, calls)) == SHAPES[1]
    assert T.choose(("dev",), 5000, SHAPES, _timer(TIMES, calls)) == SHAPES[1]
    assert len(calls) == T.ROUNDS * len(SHAPES)


def test_no_store_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "WARM_S", 0.0)
    monkeypatch.delenv(S.CACHE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    T.choose(("dev",), 5000, SHAPES, _timer(TIMES, []))
    assert S.path() is None and list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_an_engine_takes_its_launch_shape_from_the_store(tuner, make_arena, monkeypatch):
    """End to end: an engine's first plan in a bucket measures and stores; a new process's
    engine plans the same from the store without timing; a rebuilt kernel (another SPIR-V
    digest in the layer signature) measures again."""
    from kvdict_vk.vk.attend import engine as A
    monkeypatch.setattr(A, "timestamps_usable", lambda dev: True)
    rng = np.random.default_rng(3)
    arena = make_arena(1, 2, 64, 700, guard_words=64, cache="f16")
    rows = rng.standard_normal((2, 700, 64), dtype=np.float32)
    arena.append(0, rows, rows)
    timed = []

    def engine():
        att = A.Attention(arena, 4)
        att.path, att.tune = "flash", True
        # the device's "measurement": 512 workgroups with the wide end are fastest
        monkeypatch.setattr(att, "time_plan", lambda layer, n, plan: timed.append(plan) or (
            1e-5 if (plan.kernel, plan.local) == ("wide_end", att.shapes.flash_locals(0)[-1]) else 2e-5))
        return att
    first = engine()
    plan = first.plan(0, 700)
    n_timed = len(timed)
    assert n_timed > 0 and plan.kernel == "wide_end" and tuner.is_file()
    first.free()
    monkeypatch.setattr(T, "_CHOICES", {})  # a new process
    second = engine()
    assert second.plan(0, 700) == plan and len(timed) == n_timed
    second.free()
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "TUNED_VARIANTS", T.TUNED_VARIANTS[:-1])  # as if a shader were rebuilt
    third = engine()
    third.plan(0, 700)
    assert len(timed) == 2 * n_timed
    third.free()


@pytest.mark.gpu
def test_the_encoder_choice_outlives_the_process(tuner, make_arena, activate, monkeypatch):
    """encode_choice on a GPU (lavapipe posing as one): the first append of a (format, batch
    bucket) measures and stores; a new process takes the stored encoder without measuring; a
    host with another CPU, or a damaged entry, measures again. CPU drivers store nothing."""
    from kvdict_vk.vk.device import Device
    monkeypatch.setattr(C, "_CHOICES", {})
    rng = np.random.default_rng(5)
    hd, n_kv = 32, 2
    activate(random_artifact(rng, hd, 64, [((4, 4), (4, 0))], n_heads=n_kv))
    arena = make_arena(1, n_kv, hd, 400, encoder="auto")
    rows = [rng.standard_normal((n_kv, 8, hd), dtype=np.float32) for _ in range(2)]
    if arena.device.is_cpu:
        arena.append(0, *rows)
        assert not tuner.exists()  # the codec, unmeasured: nothing to keep
    monkeypatch.setattr(Device, "is_cpu", property(lambda self: False))
    calls = []
    monkeypatch.setattr(C, "_measure", lambda *a: calls.append(a) or GPU_FASTER)
    monkeypatch.setattr(C, "_CHOICES", {})
    assert C.choose(arena.memory, 0, rows, arena.stream_dict, arena.gpu_encoder) == "gpu" and len(calls) == 1
    monkeypatch.setattr(C, "_CHOICES", {})  # a new process
    assert C.choose(arena.memory, 0, rows, arena.stream_dict, arena.gpu_encoder) == "gpu" and len(calls) == 1
    monkeypatch.setattr(C, "_CHOICES", {})
    monkeypatch.setattr(S, "host_cpu", lambda: "another CPU x2")
    assert C.choose(arena.memory, 0, rows, arena.stream_dict, arena.gpu_encoder) == "gpu" and len(calls) == 2
    stored = json.loads(tuner.read_text())["choices"]
    assert sum(k.startswith(json.dumps([C.STORE_KIND])[:-1]) for k in stored) == 2
    for entry in stored.values():
        entry["choice"] = "tpu"  # not one of its candidates
    tuner.write_text(json.dumps({"version": S.STORE_VERSION, "choices": stored}))
    monkeypatch.setattr(C, "_CHOICES", {})
    assert C.choose(arena.memory, 0, rows, arena.stream_dict, arena.gpu_encoder) == "gpu" and len(calls) == 3
