"""The exact window in the forge: ForgeConfig / kvdict-forge --sink --recent, the learned
artifact carrying it, certification through pipeline.RuntimeHook with the artifact's window
(the same per-query mask as kvdict_vk.window), the one byte charge, the row names. (The
payload's `window` key: tests/unit/test_artifact.py.)"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk import runtime
from kvdict_vk.forge import certify, cli, levers, llama, pipeline as P
from kvdict_vk.window import NO_WINDOW, ExactWindow

from helpers import toy_artifact


def test_config_default_has_no_window_and_row_name_unchanged():
    cfg = P.ForgeConfig()
    assert (cfg.window_sink, cfg.window_recent) == (0, 0) and cfg.exact_window() == NO_WINDOW
    assert P.dict_row_name(cfg) == "dict 1024 shared atoms, K 4+6 b, V 4+4 b"
    assert levers.dictionary_row_names(cfg) == [
        "dict 1024 shared atoms, K 4+6 b, V 4+4 b + group scales",
        f"dict 1024 shared atoms, K 4+6 b, V 4+4 b + sink + {levers.RECENT} recent"]


@pytest.mark.parametrize("sink,recent,tail", [(1, 32, " + sink 1 + 32 recent"), (0, 64, " + 64 recent"),
                                              (4, 0, " + sink 4")])
def test_row_name_names_the_window(sink, recent, tail):
    cfg = P.ForgeConfig(window_sink=sink, window_recent=recent)
    assert P.dict_row_name(cfg) == "dict 1024 shared atoms, K 4+6 b, V 4+4 b" + tail
    # the window lever is the certified row's own window then: only the group-scale lever
    assert levers.dictionary_row_names(cfg) == [P.dict_row_name(cfg) + " + group scales"]


def _parsed_config(monkeypatch, argv) -> P.ForgeConfig:
    seen = {}

    def build(cfg, out, name, **kw):
        seen["cfg"] = cfg
        return 0, {}
    monkeypatch.setattr(cli, "build", build)
    assert cli.main(argv) == 0
    return seen["cfg"]


def test_cli_sink_and_recent(monkeypatch, tmp_path):
    cfg = _parsed_config(monkeypatch, ["--out", str(tmp_path), "--sink", "1", "--recent", "32"])
    assert (cfg.window_sink, cfg.window_recent) == (1, 32) and cfg.exact_window() == ExactWindow(1, 32)
    cfg = _parsed_config(monkeypatch, ["--out", str(tmp_path)])
    assert cfg.exact_window() == NO_WINDOW


@pytest.mark.parametrize("argv", [["--sink", "-1"], ["--recent", "5000"], ["--sink", "257"]])
def test_cli_refuses_a_window_out_of_range(monkeypatch, tmp_path, capsys, argv):
    monkeypatch.setattr(cli, "build", lambda *a, **k: pytest.fail("built with a bad window"))
    assert cli.main(["--out", str(tmp_path)] + argv) == 2
    assert "window" in capsys.readouterr().err


def test_cli_has_no_window_field_options():
    with pytest.raises(SystemExit):
        cli.main(["--window-sink", "1"])


@pytest.mark.parametrize("window", [NO_WINDOW, ExactWindow(1, 32), ExactWindow(0, 5), ExactWindow(3, 0),
                                    ExactWindow(2, 7)])
def test_runtime_hook_mask_is_the_window(window):
    """The certified path's per-query exact mask (forge.llama) is kvdict_vk.window's rule at
    every decode step: the query at t sees t + 1 cached tokens."""
    hook = P.RuntimeHook(window)
    assert (hook.exact_sink, hook.exact_recent, hook.exact_group) == (window.sink, window.recent, 1)
    assert P.RuntimeHook().exact_sink == 0 and P.RuntimeHook().exact_recent == 0
    T = 40
    mask = np.broadcast_to(llama.exact_mask(hook, np.arange(T), T), (T, T))  # no recent: one row
    for t in range(T):
        assert np.array_equal(mask[t, : t + 1], window.exact(t + 1)), t


def test_window_lever_is_the_runtime_hook():
    assert levers.WINDOW == ExactWindow(1, levers.RECENT)
    art = toy_artifact(np.random.default_rng(0))
    inst = levers.Installed(art, P.RuntimeHook(levers.WINDOW))
    assert (inst.exact_sink, inst.exact_recent, inst.exact_group) == (1, levers.RECENT, 1)


def test_windowed_bytes_one_charge():
    assert P.windowed_bytes(60.0, 1024, 64, NO_WINDOW) == 60.0
    # the window's binary16 rows beside every token's slot (the arena keeps both)
    assert P.windowed_bytes(60.0, 1024, 64, ExactWindow(1, 32)) == pytest.approx(60.0 + 33 * 128 / 1024)
    assert P.windowed_bytes(60.0, 256, 64, ExactWindow(0, 4096)) == pytest.approx(60.0 + 128.0)  # every token exact


def _rows(art, cfg, coded=60.0):
    return {r.name: r for r in levers.dictionary_rows(art, cfg, coded)}


def test_lever_rows_charge_the_artifacts_window():
    art = toy_artifact(np.random.default_rng(1))
    cfg = P.ForgeConfig()
    rows = _rows(art, cfg)
    assert list(rows) == levers.dictionary_row_names(cfg)
    grouped, windowed = rows.values()
    hd, ctx = art.head_dim, cfg.gate_window()
    assert grouped.bytes_per_vector == 60.0 + 2 * hd / 32
    assert windowed.bytes_per_vector == P.windowed_bytes(60.0, ctx, hd, levers.WINDOW)
    hook = windowed.hook()
    assert (hook.exact_sink, hook.exact_recent) == (1, levers.RECENT)
    # an artifact with its own window: the group-scale lever keeps it, in bytes and in its mask
    wcfg = dataclasses.replace(cfg, window_sink=2, window_recent=16)
    wart = dataclasses.replace(art, window=wcfg.exact_window())
    (name, row), = _rows(wart, wcfg).items()
    assert name == levers.dictionary_row_names(wcfg)[0]
    assert row.bytes_per_vector == P.windowed_bytes(60.0 + 2 * hd / 32, ctx, hd, wart.window)
    hook = row.hook()
    assert (hook.exact_sink, hook.exact_recent) == (2, 16)


def test_certify_artifact_runs_with_the_artifacts_window(monkeypatch):
    seen = []

    def evaluate(windows, hook, base_nll=None):
        seen.append((hook.exact_sink, hook.exact_recent, runtime.dict_active()))
        return "result"
    monkeypatch.setattr(certify, "evaluate", evaluate)

    class Set:
        class text:
            name = "t"
        windows, base_nll = [], None
    art = toy_artifact(np.random.default_rng(2))
    for window in (NO_WINDOW, ExactWindow(1, 32)):
        assert P.certify_artifact(dataclasses.replace(art, window=window), [Set]) == {"t": "result"}
        assert seen[-1] == (window.sink, window.recent, True) and not runtime.dict_active()


def _stream(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((12, 64))
    return (rng.standard_normal((3, 200, 12)) @ basis + 0.1 * rng.standard_normal((3, 200, 64))).astype(np.float32)


def test_learned_artifact_carries_the_window(monkeypatch):
    monkeypatch.setenv("KVDICT_FORGE_WORKERS", "1")
    kv = [(_stream(1), _stream(2))]
    cfg = P.ForgeConfig(n_atoms=16, train_vectors=200, iters=1, k_bits=2, v_bits=2, window_sink=1, window_recent=32)
    art = P.learn_artifact(kv, cfg)
    assert art.window == ExactWindow(1, 32)
    assert P.learn_artifact(kv, dataclasses.replace(cfg, window_sink=0, window_recent=0)).window == NO_WINDOW
    with pytest.raises(E.DimsError):
        P.learn_artifact(kv, dataclasses.replace(cfg, window_recent=-1))


def test_curve_refuses_a_window(tmp_path, capsys):
    assert cli.main(["curve", "--out", str(tmp_path), "--recent", "32"]) == 2
    assert "curve" in capsys.readouterr().err
