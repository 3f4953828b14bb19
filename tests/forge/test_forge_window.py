"""kvdict-forge --smoke --sink 1 --recent 32 end to end: the window reaches the artifact, the
header and the certified row, and the gate measures what the window lever measures."""
from __future__ import annotations

import dataclasses

import pytest

from kvdict_vk.forge import cli, levers, pipeline as P
from kvdict_vk.window import NO_WINDOW


@pytest.mark.slow
def test_smoke_forge_with_a_window(tmp_path):
    """kvdict-forge --smoke --sink 1 --recent 32: the artifact carries the window, the header
    records it, the certified row is named and charged for it, and the gate's numbers are the
    window lever's on the same dictionaries without a window (one implementation)."""
    import json

    from kvdict_vk import artifact as A
    from kvdict_vk.forge import table
    assert cli.main(["--smoke", "--out", str(tmp_path), "--name", "w", "--threshold", "0.5",
                     "--sink", "1", "--recent", str(levers.RECENT)]) == 0
    cert, art = A.read_artifact(tmp_path / "w.q42art")
    assert art.window == levers.WINDOW
    assert (cert.producer["config"]["window_sink"], cert.producer["config"]["window_recent"]) == (1, levers.RECENT)
    summary = json.loads((tmp_path / "w.json").read_text())
    cfg = P.ForgeConfig(**{k: tuple(v) if isinstance(v, list) and k in ("texts", "calib_files") else v
                           for k, v in summary["config"].items()})
    bpv = summary["bytes_per_vector"]
    assert bpv["certified_row"] == P.windowed_bytes(bpv["all"], cfg.gate_window(), art.head_dim, art.window)
    fid = json.loads((tmp_path / "w-fidelity.json").read_text())
    assert fid["default"] == P.dict_row_name(cfg) and fid["default"].endswith(f" + sink 1 + {levers.RECENT} recent")
    row = fid["texts"]["gpl3"]["rows"][0]
    assert row["name"] == fid["default"] and row["bytes_per_vector"] == bpv["certified_row"]
    plain_cfg = dataclasses.replace(cfg, window_sink=0, window_recent=0)
    plain = dataclasses.replace(art, window=NO_WINDOW)
    lever = [r for r in levers.dictionary_rows(plain, plain_cfg, bpv["all"]) if "recent" in r.name]
    assert lever[0].bytes_per_vector == bpv["certified_row"]
    sets = P.eval_sets(cfg, str(tmp_path / "cache"))
    measured = table.measure(lever, sets, None, log=lambda m: None)[0]["texts"]
    for t in cert.extra["texts"]:
        assert measured[t["name"]]["delta_rel"] == t["value"], t["name"]


@pytest.mark.slow
def test_smoke_forge_ranks_the_certified_caches(tmp_path):
    """kvdict-forge --smoke --table-rows 'q8_0;KIVI 4 bit + 128 recent': the dictionary and the
    two caches gated on the same windows, ranked by their whole arena at the model's context
    (<name>-ranking.json), the winner named with the cache KvArena keeps for it."""
    import json

    from kvdict_vk.forge import ranking
    assert cli.main(["--smoke", "--out", str(tmp_path), "--name", "r", "--threshold", "0.5",
                     "--table-rows", ";".join(ranking.RANKED_BASELINES)]) == 0
    ranked = json.loads((tmp_path / "r-ranking.json").read_text())
    names = [r["name"] for r in ranked["rows"]]
    assert sorted(names) == sorted([*ranking.RANKED_BASELINES, P.dict_row_name(cli.config_from_args(
        cli.argparse.Namespace(smoke=True, **{f.name: None for f in dataclasses.fields(P.ForgeConfig)})))])
    passing = [r for r in ranked["rows"] if r["passes"]]
    assert passing and ranked["winner"] == passing[0]["name"]
    assert [r["arena_bytes"] for r in passing] == sorted(r["arena_bytes"] for r in passing)
    default = ranked["default"]
    if ranked["winner_kind"] == "dictionary":
        assert default == {"cache": "dict", "artifact": str(tmp_path / "r.q42art")}
    else:
        cache, spec = ranking.engine_cache(ranked["winner"], (30, 3, 64))
        assert default["cache"] == cache and default.get("kivi") == (dataclasses.asdict(spec) if spec else None)


@pytest.mark.slow
def test_smoke_forge_codes_keys_before_rope(tmp_path, make_arena, activate):
    """kvdict-forge --smoke --pre-rope-keys 1: the artifact records the model's RoPE, its gate
    (the engine's path: post-RoPE keys turned back, coded, turned again) measures what the
    pre-RoPE lever's hook (keys coded where the forward makes them) measures, and the arena
    decodes the forge's slots of a captured window to its reconstruction within 1e-9."""
    import json

    import numpy as np

    from kvdict_vk import artifact as A, codec
    from kvdict_vk.forge import gguf_model, llama, pre_rope, table
    from kvdict_vk.metrics import nmse
    from kvdict_vk.rope import KeyRope
    assert cli.main(["--smoke", "--out", str(tmp_path), "--name", "p", "--threshold", "0.5",
                     "--pre-rope-keys", "1"]) == 0
    cert, art = A.read_artifact(tmp_path / "p.q42art")
    c = gguf_model.load_model().config
    assert art.key_rope == KeyRope(c.rope_theta, c.rope_dim)
    assert cert.producer["config"]["pre_rope_keys"] is True
    summary = json.loads((tmp_path / "p.json").read_text())
    cfg = P.ForgeConfig(**{k: tuple(v) if isinstance(v, list) and k in ("texts", "calib_files") else v
                           for k, v in summary["config"].items()})
    assert P.dict_row_name(cfg).endswith("keys before RoPE")
    sets = P.eval_sets(cfg, str(tmp_path / "cache"))
    row = table.Row("lever", "dictionary", 60.0, lambda: pre_rope.PreRopeKeysHook(art), "x")
    lever = table.measure([row], sets, None, log=lambda m: None)[0]["texts"]
    for t in cert.extra["texts"]:  # the same codes but for float32 ties: the same loss within noise
        assert abs(lever[t["name"]]["delta_rel"] - t["value"]) <= 2e-3, t["name"]
    window = sets[0].windows[0][:200]
    layer = 0
    kv = llama.capture_kv(window)[layer]  # (K after RoPE, V, K before RoPE)
    dk, dv = art.layers[layer]
    activate(art)
    arena = make_arena(art.n_layers, c.n_kv_heads, art.head_dim, len(window))
    k_slots, v_slots = codec.encode_heads(kv[2], dk), codec.encode_heads(kv[1], dv)
    arena.append_codes(layer, k_slots, v_slots)
    forge_k = llama.apply_rope(codec.roundtrip_heads(kv[2], dk), np.arange(len(window)), c.rope_theta, c.rope_dim)
    got_k, got_v = arena.read(layer)
    assert nmse(forge_k, got_k) <= 1e-9 and nmse(codec.roundtrip_heads(kv[1], dv), got_v) <= 1e-9


@pytest.mark.parametrize("flags", [["--sink", "1"], ["--pre-rope-keys", "1"]])
def test_curve_refuses_what_it_does_not_measure(tmp_path, capsys, flags):
    """kvdict-forge curve measures caches without a window, on the keys after RoPE: it refuses
    those flags (exit 2) before learning anything."""
    assert cli.main(["curve", "--out", str(tmp_path / "c"), *flags]) == 2
    assert flags[0].lstrip("-").split("-")[0] in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
