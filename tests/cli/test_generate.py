"""kvdict-generate and kvdict_vk.bench.generate: the device forward as a user runs it, and its
tokens/s table beside llama.cpp's (a stand-in llama-bench here: its JSON parsed into rows)."""
from __future__ import annotations

import json
import stat

import numpy as np
import pytest

from kvdict_vk.model_file import ModelConfig, open_reader, read_config
from kvdict_vk.vk.forward.weights import from_gguf, random_weights, to_gguf

TINY = ModelConfig("llama", 2, 96, 6, 2, 32, 160, 10000.0, 32, 1e-5, 300, 64, False)


def test_smollm2_shapes_are_the_ggufs():
    from kvdict_vk.bench.generate import smollm2_shapes
    assert smollm2_shapes() == read_config(open_reader())


@pytest.mark.parametrize("fmt,embedding", [("q4_1", "q8_0"), ("q8_0", None), ("f32", "q4_1")])
def test_a_gguf_written_reads_back_the_same(fmt, embedding, tmp_path):
    w = random_weights(TINY, np.random.default_rng(3), fmt, embedding)
    to_gguf(w, tmp_path / "m.gguf")
    r = from_gguf(tmp_path / "m.gguf")
    assert r.config == w.config.__class__(**{**vars(w.config), "rms_eps": r.config.rms_eps})
    assert np.float32(r.config.rms_eps) == np.float32(TINY.rms_eps)
    for a, b in zip(w.layers, r.layers):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            assert getattr(a, name).fmt == getattr(b, name).fmt
            np.testing.assert_array_equal(getattr(a, name).words, getattr(b, name).words)
        np.testing.assert_array_equal(a.ffn_norm, b.ffn_norm)
    np.testing.assert_array_equal(w.tok_embd.words, r.tok_embd.words)
    np.testing.assert_array_equal(w.output.words, r.output.words)
    assert r.tok_embd.fmt == (embedding or fmt)


@pytest.mark.gpu
def test_generate_benchmark_rows_beside_llama_bench(tmp_path, restore_env, vk_device):
    """Rows in the issue's schema for both engines; the summary's ratios from them. The
    stand-in llama-bench answers with llama-bench's JSON and records the arguments it got."""
    from kvdict_vk.bench import generate
    gguf = tmp_path / "tiny.gguf"
    to_gguf(random_weights(TINY, np.random.default_rng(4), "q4_1", "q8_0"), gguf)
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho \"$@\" >> " + str(tmp_path / "args") + "\n"
                    "echo '[{\"n_prompt\": 0, \"n_gen\": 2, \"n_depth\": 48, \"avg_ts\": 50.0, \"stddev_ts\": 1.0}]'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "generate.json"
    assert generate.main(["--gguf", str(gguf), "--contexts", "48", "--caches", "f16,q8_0,kivi,dict", "--tokens", "2",
                          "--llama-bench", str(fake), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["engine"], r["cache"], r["n_ctx"]) for r in rows] == [
        ("kvdict", "f16", 48), ("llama.cpp", "f16", 48), ("kvdict", "q8_0", 48), ("llama.cpp", "q8_0", 48),
        ("kvdict", "kivi", 48), ("kvdict", "dict", 48)]  # llama.cpp has no KIVI or dictionary cache
    keys = {"engine", "cache", "n_ctx", "batch", "tokens_per_s", "host_us_per_token", "gpu_us_per_token", "command"}
    for r in rows:
        assert keys <= set(r) or (r["engine"] == "kvdict" and "gpu_us_per_token" not in r), r
        assert r["tokens_per_s"] > 0 and r["batch"] == 1
    ours = [r for r in rows if r["engine"] == "kvdict"]
    assert all(r["tokens_per_s"] == pytest.approx(1 / r["wall_s"]["median"]) for r in ours)
    assert all(r["arena_bytes"] > 0 and r["weight_bytes"] > 0 for r in ours)
    s = result["summary"]["48"]
    fastest = max((r for r in ours if r["cache"] != "f16"), key=lambda r: r["tokens_per_s"])
    assert s["best_compressed"] == fastest["cache"]
    assert s["best_compressed_over_f16"] == pytest.approx(fastest["tokens_per_s"] / ours[0]["tokens_per_s"])
    assert s["kvdict_over_llama_f16"] == pytest.approx(ours[0]["tokens_per_s"] / 50.0)
    args = (tmp_path / "args").read_text().splitlines()
    assert len(args) == 2 and "-ctk f16 -ctv f16" in args[0] and "-d 48" in args[0] and "-ctk q8_0" in args[1]


def test_generate_benchmark_batches(tmp_path, restore_env, vk_device):
    """--batches: a row per batch (the dictionary cache's only of one), its rate the batch's
    tokens a step, its per-token times a step's over the batch, its seq_tile --seq-tile's
    within the batch; the summary per depth and batch."""
    from kvdict_vk.bench import generate
    gguf = tmp_path / "tiny.gguf"
    to_gguf(random_weights(TINY, np.random.default_rng(4), "q4_1", "q8_0"), gguf)
    out = tmp_path / "generate.json"
    assert generate.main(["--gguf", str(gguf), "--contexts", "48", "--caches", "f16,kivi,dict", "--batches", "1,3",
                          "--seq-tile", "2", "--tokens", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["cache"], r["batch"]) for r in rows] == [("f16", 1), ("f16", 3), ("kivi", 1), ("kivi", 3), ("dict", 1)]
    for r in rows:
        assert r["seq_tile"] == min(2, r["batch"])
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["wall_s"]["median"])
        if "gpu_s" in r:
            assert r["gpu_us_per_token"] == pytest.approx(1e6 * r["gpu_s"]["median"] / r["batch"])
    by = {(r["cache"], r["batch"]): r["tokens_per_s"] for r in rows}
    assert set(result["summary"]) == {"48", "48 × 3"}
    assert result["summary"]["48 × 3"]["best_compressed_over_f16"] == pytest.approx(by["kivi", 3] / by["f16", 3])


@pytest.mark.gpu
def test_kvdict_generate_prints_text_speed_and_memory(capsys, restore_env, vk_device):
    from kvdict_vk.cli import generate
    assert generate.main(["--prompt", "The GNU General Public License is", "--tokens", "3",
                          "--device", str(vk_device.info.index)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The GNU General Public License is") and "tok/s" in out
    assert "weights" in out and "KV arena" in out
    assert generate.main(["--tokens", "0"]) == 1
    assert "--tokens" in capsys.readouterr().err
    assert generate.main(["--tokens", "2", "--cache", "kivi", "--device", str(vk_device.info.index)]) == 0
    assert "kivi KV arena" in capsys.readouterr().out


@pytest.mark.gpu
def test_kvdict_generate_over_a_certified_dictionary(tmp_path, capsys, restore_env, vk_device):
    """--cache dict decodes through the artifact's dictionaries (SmolLM2's shapes: shared, every
    layer coded), each token's K/V coded on the device; an uncertified artifact is refused."""
    from helpers import toy_cert
    from kvdict_vk import artifact as A
    from kvdict_vk import runtime, synthetic
    from kvdict_vk.bench.generate import smollm2_shapes
    from kvdict_vk.cli import generate
    from kvdict_vk.dictionary import KvDictArtifact
    cfg = smollm2_shapes()
    dicts = synthetic.random_dicts(np.random.default_rng(5), cfg.head_dim, 64, 4, (6, 4))
    art = KvDictArtifact(cfg.head_dim, 64, 4, ((dicts[0], dicts[1]),) * cfg.n_layers)
    before = runtime.snapshot()
    for passed, code in ((True, 0), (False, 1)):
        path = tmp_path / f"{passed}.q42art"
        A.write_artifact(path, art, toy_cert(art, passed=passed, n_kv_heads=cfg.n_kv_heads))
        assert generate.main(["--tokens", "2", "--cache", "dict", "--artifact", str(path),
                              "--device", str(vk_device.info.index)]) == code
        out, err = capsys.readouterr()
        assert ("dict KV arena" in out) if passed else ("kvdict-generate:" in err and "dict KV arena" not in out)
    after = runtime.snapshot()  # the artifact was the arena's: the switch is as it was
    assert (after.enabled, after.artifact, after.cert) == (before.enabled, before.artifact, before.cert)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["layer", "head"])
def test_split_benchmark_rows(tmp_path, restore_env, vk_device, how):
    """kvdict_vk.bench.split on two logical devices: a row for one device and one for the split
    per cache, each device's arena, weights and GPU time, and the split fitting a longer context."""
    from kvdict_vk.bench import split
    out = tmp_path / "split.json"
    assert split.main(["--model", "tiny", "--contexts", "40", "--caches", "f16,dict", "--tokens", "2", "--logical",
                       "--split", how, "--device", str(vk_device.info.index), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cache"], r["devices"], r["split"]) for r in rows] == [
        ("f16", 1, None), ("f16", 2, how), ("dict", 1, None), ("dict", 2, how)]
    for one, two in zip(rows[::2], rows[1::2]):
        assert len(two["arena_bytes"]) == len(two["weight_bytes"]) == len(two["gpu_us_per_token"]) == 2
        assert max(two["weight_bytes"]) < one["weight_bytes"][0] <= sum(two["weight_bytes"])
        assert max(two["arena_bytes"]) < one["arena_bytes"][0]
        assert two["largest_ctx"] > one["largest_ctx"] > 0
        assert all(r["tokens_per_s"] > 0 and r["host_us_per_token"] is not None for r in (one, two))


@pytest.mark.gpu
def test_split_benchmark_over_ranks(tmp_path, restore_env, vk_device):
    """--ranks 2: the split's row from two gloo ranks (a process each on the session's device),
    with each rank's GPU time, exchange time and part."""
    from kvdict_vk.bench import split
    out = tmp_path / "split.json"
    assert split.main(["--model", "tiny", "--contexts", "40", "--caches", "f16", "--tokens", "2", "--ranks", "2",
                       "--device", str(vk_device.info.index), "--out", str(out)]) == 0
    one, two = json.loads(out.read_text())["rows"]
    assert (one["devices"], two["devices"], two["split"], two["ranks"]) == (1, 2, "layer", True)
    assert len(two["exchange_us_per_token"]) == len(two["gpu_us_per_token"]) == 2
    assert all(x > 0 for x in two["exchange_us_per_token"]) and two["tokens_per_s"] > 0
    assert max(two["weight_bytes"]) < one["weight_bytes"][0] and two["largest_ctx"] > one["largest_ctx"]


def test_split_benchmark_model_shapes():
    """bench.split's models: SmolLM2's, the 32-layer 8 × 128 one issue 53 opens with, the smoke
    test's; each makes its random weights."""
    from kvdict_vk.bench.generate import smollm2_shapes
    from kvdict_vk.bench.split import model_shapes
    assert model_shapes("smollm2") == smollm2_shapes()
    wide = model_shapes("wide")
    assert (wide.n_layers, wide.n_kv_heads, wide.head_dim, wide.tied_output) == (32, 8, 128, False)
    w = random_weights(model_shapes("tiny"), np.random.default_rng(0), "q4_1", "q8_0")
    assert len(w.layers) == 3 and w.output is w.tok_embd
    with pytest.raises(SystemExit):
        model_shapes("huge")
