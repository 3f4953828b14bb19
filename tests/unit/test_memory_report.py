"""kvdict_vk.memory_report: the whole arena at a context length is the sum of the layer
buffers build_layout computes; effective bytes per vector; kvdict-dump's and the demo's
memory lines; the certificate's optional memory field; fidelity.json's memory fields."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvdict_vk import artifact as A
from kvdict_vk import kivi as K
from kvdict_vk import layout as L
from kvdict_vk import memory_report as M
from kvdict_vk.cli import dump

from helpers import toy_artifact, toy_cert

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SMOL = (30, 3, 64)


def _caches(n_layers=SMOL[0], n_kv=SMOL[1], hd=SMOL[2]):
    return {
        "f16": "f16", "f32": "f32", "q8_0": "q8_0", "kivi": K.KiviSpec(), "kivi 3+32": K.KiviSpec(3, 3, 32),
        "dict per-head": M.dictionary_spec(n_layers, n_kv, hd),
        "dict shared": M.dictionary_spec(n_layers, n_kv, hd, 512, (4, 4), (4, 3), per_head=False),
        "dict f32 atoms": M.dictionary_spec(n_layers, n_kv, hd, atoms_f16=False),
    }


def _layout(n_layers, n_kv, hd, n_ctx, cache):
    if isinstance(cache, K.KiviSpec):
        return L.build_layout(n_layers, n_kv, hd, n_ctx, cache="kivi", kivi=cache)
    if isinstance(cache, L.DictSpec):
        return L.build_layout(n_layers, n_kv, hd, n_ctx, cache)
    return L.build_layout(n_layers, n_kv, hd, n_ctx, cache=cache)


@pytest.mark.parametrize("name", list(_caches()))
def test_arena_is_the_sum_of_the_layer_buffers(name):
    cache = _caches()[name]
    lengths = (1000, 4096, 8192, 32768, 131072)
    for m in M.arena_memory(*SMOL, cache, lengths):
        lay = _layout(*SMOL, m.n_ctx, cache)
        assert m.arena_bytes == sum(ll.total_bytes for ll in lay.layers) == lay.total_bytes
        t = dump.describe(lay)["totals"]  # kvdict-dump's own count of the same blocks
        assert (m.region_bytes, m.tail_bytes, m.padding_bytes) == (t["region_bytes"], t["tail_bytes"],
                                                                   t["padding_bytes"])
        assert m.bytes_per_token == lay.bytes_per_token
        assert m.effective_bytes_per_vector == m.arena_bytes / (30 * 3 * 2 * m.n_ctx)
        assert m.f16_arena_bytes == _layout(*SMOL, m.n_ctx, "f16").total_bytes
        assert m.vs_f16 == m.arena_bytes / m.f16_arena_bytes


def test_f16_is_128_bytes_a_vector_at_any_length():
    for m in M.arena_memory(*SMOL, "f16", (64, 1024, 8192, 32768, 131072)):
        assert m.effective_bytes_per_vector == 128.0 and m.tail_bytes == 0 and m.vs_f16 == 1.0
    assert [m.effective_bytes_per_vector for m in M.arena_memory(2, 4, 64, "f16", (512, 2048))] == [128.0, 128.0]


def test_dictionary_amortises_toward_its_slot_bytes():
    spec = M.dictionary_spec(*SMOL, per_head=True)
    lengths = (1024, 4096, 8192, 32768, 131072, 1 << 20)
    at = M.arena_memory(*SMOL, spec, lengths)
    slot = at[0].bytes_per_token / (30 * 3 * 2)
    assert slot == 60.0
    eff = [m.effective_bytes_per_vector for m in at]
    assert all(a > b for a, b in zip(eff, eff[1:])) and all(e > slot for e in eff)
    assert eff[-1] - slot < 0.4 and eff[0] > 2 * slot
    for m in at:  # what is left above the slot is the dictionaries (and padding) spread over the tokens
        assert m.effective_bytes_per_vector - slot == (m.tail_bytes + m.padding_bytes) / (180 * m.n_ctx)
    assert len({m.tail_bytes for m in at}) == 1  # the dictionaries do not grow with the length
    # at 8 192 tokens: 107.0 MiB, 22.6 MiB of it dictionaries (one binary16 copy of the atoms,
    # 30 layers × 2 streams × 3 heads × 1 024 × 64 halves, and float32 means and scales), 0.59
    # of f16 — the 152.0 / 67.6 / 0.84 kept a float32 copy beside the binary16 one
    m = at[2]
    atoms = 30 * 2 * 3 * 1024 * 64 * 2
    assert m.tail_bytes == atoms + 30 * 2 * 3 * 64 * 4 * 2
    assert round(m.arena_bytes / 2 ** 20, 1) == 107.0 and round(m.tail_bytes / 2 ** 20, 1) == 22.6
    assert round(m.vs_f16, 2) == 0.59
    f32 = M.arena_memory(*SMOL, M.dictionary_spec(*SMOL, per_head=True, atoms_f16=False), (8192,))[0]
    assert f32.tail_bytes - m.tail_bytes == atoms  # float32 atoms: twice the bytes
    # the forge's default since: one dictionary a stream shared by the 3 KV heads, a third of
    # the tail — 91.9 MiB at 8 192 tokens, 0.51 of f16
    shared = M.arena_memory(*SMOL, M.dictionary_spec(*SMOL), (8192,))[0]
    assert shared.tail_bytes * 3 == m.tail_bytes and shared.region_bytes == m.region_bytes
    assert round(shared.arena_bytes / 2 ** 20, 1) == 91.9 and round(shared.vs_f16, 2) == 0.51


def test_kivi_statistics_grow_and_window_amortises():
    at = M.arena_memory(*SMOL, "kivi", (8192, 32768, 131072))
    assert [m.tail_bytes for m in at] == sorted({m.tail_bytes for m in at})  # key statistics grow
    assert round(at[0].arena_bytes / 2 ** 20, 1) == 59.8
    assert 40 < at[-1].effective_bytes_per_vector < at[0].effective_bytes_per_vector


def test_modelled_adds_what_it_states():
    spec = M.dictionary_spec(*SMOL)
    base, = M.arena_memory(*SMOL, spec, (8192,))
    m, = M.arena_memory(*SMOL, M.Modelled(spec, 4.0, 1000, "x"), (8192,))
    assert m.arena_bytes == base.arena_bytes + 4 * 180 * 8192 + 1000
    bare, = M.arena_memory(*SMOL, M.Modelled(None, 40.0, 0, "rows"), (8192,))
    assert bare.effective_bytes_per_vector == 40.0


def test_report_lengths():
    assert M.report_lengths(4096) == [4096, 8192, 32768, 131072]
    assert M.report_lengths(8192) == [8192, 32768, 131072]
    assert M.report_lengths(None, 2048) == [2048, 32768, 131072]


@pytest.fixture(scope="module")
def art_file(tmp_path_factory):
    rng = np.random.default_rng(5)
    art = toy_artifact(rng, n_layers=3, n_atoms=40, head_dim=16, s=3, passthrough=((1, 1),))
    p = tmp_path_factory.mktemp("mem") / "t.q42art"
    A.write_artifact(p, art, toy_cert(art))
    return p, art


def test_dump_json_carries_the_memory_block(art_file, capsys):
    p, art = art_file
    assert dump.main([str(p), "--n-ctx", "100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    mem = d["memory"]
    assert [m["n_ctx"] for m in mem["lengths"]] == [100, 8192, 32768, 131072]
    want = M.arena_memory(3, 2, 16, art, (100, 8192, 32768, 131072))
    assert mem["lengths"] == [m.to_dict() for m in want]
    assert mem["lengths"][0]["arena_bytes"] == d["totals"]["bytes"]
    assert dump.main([str(p), "--n-ctx", "100"]) == 0
    out = capsys.readouterr().out
    assert "memory" in out and "B/vector (effective)" in out and "131072" in out


def test_dump_memory_for_uncoded_and_kivi_caches(capsys):
    dims = ["--n-layers", "30", "--n-kv-heads", "3", "--head-dim", "64", "--n-ctx", "8192", "--json"]
    for cache, want in (("f16", "f16"), ("kivi", K.KiviSpec()), ("q8_0", "q8_0")):
        assert dump.main(dims + ["--cache", cache]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["memory"]["lengths"] == [m.to_dict() for m in M.arena_memory(*SMOL, want, (8192, 32768, 131072))]
    assert d["memory"]["lengths"][0]["effective_bytes_per_vector"] == 68.0


def test_dump_uses_the_certificates_context(art_file):
    _, art = art_file
    cert = toy_cert(art)
    assert dump.model_n_ctx(cert) == 8192 and dump.model_n_ctx(None) == 8192
    cert.model["n_ctx"] = 2048
    assert dump.model_n_ctx(cert) == 2048


def test_demo_prints_the_whole_arena(art_file):
    from kvdict_vk.cli import demo
    p, art = art_file
    lay = L.build_layout(3, 2, 16, 256, art)
    block = demo.arena_memory(art, lay, toy_cert(art))
    lines = demo.format_arena(block)
    assert len(lines) == 3 and "8192 tokens" in lines[0] and "B/vector effective" in lines[0]
    r = _demo_report(block)
    text = demo.format_report(r)
    assert all(line in text for line in lines)
    r["memory"].pop("arena")
    assert "whole arena" not in demo.format_report(r)  # an old report still formats


def _demo_report(block):
    return dict(device="lavapipe", device_chosen_by="test", devices=["0: lavapipe"], artifact="x.q42art",
                certified=dict(delta_ppl=0.003, ci95=[0.001, 0.005], baseline_ppl=19.8, coded_ppl=19.9,
                               eval_tokens=7168, threshold=0.01, worst_text="gpl3", texts={}),
                decode=dict(tokens=8, reproduces_cpu_path=True, step_nmse_tolerance=1e-9, nll_tolerance_nats=1e-3,
                            f32=dict(steps=8, worst_step_nmse=1e-12, tokens_per_s=1.0, variant="attend_direct",
                                     nll_vs_cpu_forward=dict(max_abs_nll_diff=1e-5)),
                            dict=dict(steps=8, worst_step_nmse=1e-12, tokens_per_s=1.0, variant="attend_direct")),
                memory=dict(f32_bytes_per_token=46080, dict_bytes_per_token=10800, compression_vs_f32=4.27,
                            compression_vs_f16=2.13, dictionary_tail_bytes=1 << 20, arena=block),
                validation=dict(cases=1, passed=1, worst_nmse=1e-12, worst_encoder_rel_err_diff=0.0), seconds=1.0)


def test_certificate_memory_is_optional_and_read_back(art_file, tmp_path):
    from kvdict_vk.forge.pipeline import cert_memory
    p, art = art_file
    mem = cert_memory(art, 3, 2, 16, 8192)
    assert mem["n_ctx"] == 8192 and list(mem["arena_bytes"]) == ["8192", "32768", "131072"]
    assert mem["arena_bytes"]["8192"] == L.build_layout(3, 2, 16, 8192, art).total_bytes
    cert = toy_cert(art)
    cert = A.CertInfo(**{**cert.__dict__, "model": dict(cert.model, n_ctx=8192),
                         "producer": dict(cert.producer, memory=mem)})
    q = tmp_path / "m.q42art"
    A.write_artifact(q, art, cert)
    info, _ = A.read_artifact(q)
    assert info.producer["memory"] == mem and info.model["n_ctx"] == 8192
    old, _ = A.read_artifact(p)  # an artifact without the field still verifies
    assert "memory" not in old.producer and old.passed


@pytest.mark.parametrize("name", ["fidelity.json", "fidelity_long.json"])
def test_fidelity_json_carries_the_memory_fields(name):
    sys.path.insert(0, str(ROOT / "tools"))
    import fidelity_memory as FM
    doc = json.loads((ROOT / "docs" / "results" / name).read_text())
    command = f"python tools/fidelity_memory.py --file docs/results/{name}"
    assert doc["memory"]["command"] == command  # the file's own command, not another's
    fresh = FM.add_memory(copy.deepcopy(doc), command)
    assert fresh == doc  # the committed fields are what the script computes now
    upper = {}
    for text in doc["texts"].values():
        for row in text["rows"]:
            upper[row["name"]] = max(upper.get(row["name"], -1.0), row["ci95"][1])
    assert {n for n, u in upper.items() if u <= 0.01} >= {"q8_0", "KIVI 4 bit + 128 recent", doc["default"]}
    for text in doc["texts"].values():
        for row in text["rows"]:
            assert row["passes"] == (upper[row["name"]] <= 0.01)  # the gate, on every text
            assert set(row["effective_bytes_per_vector"]) == {"8192", "32768", "131072"}
            assert set(row["arena_bytes"]) == {"8192"}
            if row["name"] == "q8_0":
                assert row["effective_bytes_per_vector"]["32768"] == 68.0
            if row["name"] == "KIVI 4 bit + 128 recent":
                assert row["memory_model"] == "engine"
                assert row["arena_bytes"]["8192"] == M.arena_memory(*SMOL, K.KiviSpec(), (8192,))[0].arena_bytes
    if name != "fidelity.json":  # the long gate's file is one run, nothing merged
        return
    # rows keep the forge's order: its own run's (no "command"), then the rows merged from
    # another run on the same windows, each with that run's command (fidelity_memory --merge)
    own = [r for r in doc["texts"]["gpl3"]["rows"] if "command" not in r]
    merged = doc["texts"]["gpl3"]["rows"][len(own):]
    assert own[-1]["name"] == "q8_0" and all("command" in r for r in merged)
    assert doc["default"] in {r["name"] for r in merged}
    assert merged[0]["command"].startswith("kvdict-forge") and "--per-head" not in merged[0]["command"]


def test_fidelity_merge_refuses_other_windows(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import fidelity_memory as FM
    doc = json.loads((ROOT / "docs" / "results" / "fidelity.json").read_text())
    run = {"command": "kvdict-forge x", "texts": copy.deepcopy(doc["texts"])}
    for t in run["texts"].values():
        t["rows"] = [dict(t["rows"][0], name="new row")]
    merged = FM.merge(copy.deepcopy(doc), copy.deepcopy(run), "new row")
    assert merged["default"] == "new row" and merged["texts"]["pydoc"]["rows"][-1]["command"] == "kvdict-forge x"
    run["texts"]["sedfaq"]["windows"] += 1
    with pytest.raises(SystemExit, match="windows"):
        FM.merge(copy.deepcopy(doc), run)
    with pytest.raises(SystemExit, match="no row"):
        FM.merge(copy.deepcopy(doc), {"command": "c", "texts": doc["texts"]}, "absent")
