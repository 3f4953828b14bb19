"""The forge in miniature (CI smoke): learn on 2 layers, certify through the runtime path,
package; a passing artifact loads, a failing one is written with passed = false, refused
by the engine, and the command exits non-zero."""
from __future__ import annotations

import json

import pytest

from kvdict_vk import artifact as A
from kvdict_vk import errors as E
from kvdict_vk import runtime

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    from kvdict_vk.forge import cli
    out = tmp_path_factory.mktemp("forge")
    ok = cli.main(["--smoke", "--out", str(out), "--name", "ok", "--threshold", "0.5"])
    bad = cli.main(["--smoke", "--out", str(out), "--name", "bad", "--threshold", "-0.9"])
    return out, ok, bad


def test_long_context_gate_windows(tmp_path):
    """--eval-window: the gate's windows longer than the calibration's (the long-context gate's
    texts, forge.texts.LONG_TEXTS, one of each here); the certificate and the fidelity table
    record the evaluation window, and the calibration captures are the smoke run's."""
    from kvdict_vk.forge import cli
    from kvdict_vk.forge.texts import LONG_TEXTS
    assert cli.main(["--smoke", "--out", str(tmp_path), "--name", "long", "--threshold", "0.5", "--eval-window",
                     "384", "--texts", ",".join(LONG_TEXTS)]) == 0
    cert = A.read_header(tmp_path / "long.q42art")
    assert cert.extra["window"] == 384 and cert.eval_tokens == len(LONG_TEXTS) * 383
    assert [t["name"] for t in cert.extra["texts"]] == list(LONG_TEXTS)
    assert cert.producer["config"]["window"] == 256 and cert.producer["config"]["eval_window"] == 384
    fid = json.loads((tmp_path / "long-fidelity.json").read_text())
    assert {t["window"] for t in fid["texts"].values()} == {384}


def test_certified_artifact_loads(smoke_runs):
    out, ok, _ = smoke_runs
    assert ok == 0
    try:
        cert = runtime.load_certified(out / "ok.q42art")
        assert cert.passed and cert.metric == "delta_ppl_rel" and cert.eval_tokens == 3 * 255
        per_text = cert.extra["texts"]  # one 256-token window of each evaluation text
        assert [t["name"] for t in per_text] == ["gpl3", "sedfaq", "pydoc"]
        assert len({t["sha256"] for t in per_text}) == 3 and all(len(t["file_sha256"]) == 64 for t in per_text)
        assert all(t["ci95"][1] <= 0.5 for t in per_text)  # the gate: every upper bound within it
        assert cert.extra["ci95"][1] == max(t["ci95"][1] for t in per_text)
        assert cert.model["n_kv_heads"] == 3 and cert.model["gguf_sha256"]
        meta = runtime.installed_meta()
        assert meta == (4, 64)
        art = runtime.snapshot().artifact
        from kvdict_vk.forge.pipeline import ForgeConfig
        # one dictionary a stream, shared by the layer's KV heads (the default)
        assert art.n_heads == 1 and art.layers[0][0].residual_bits == ForgeConfig().k_bits
        assert art.layers[0][1].residual_bits == ForgeConfig().v_bits
        assert art.layers[5] == (None, None)  # smoke codes layers 0 and 1 only
    finally:
        runtime.deactivate()
    summary = json.loads((out / "ok.json").read_text())
    assert summary["passed"] and summary["bytes_per_vector"]["all"] > 200  # 28 passthrough layers
    assert (out / "ok.png").stat().st_size > 1000 and "| dict" in (out / "ok.md").read_text()
    fid = json.loads((out / "ok-fidelity.json").read_text())
    assert fid["command"].startswith("kvdict-forge --smoke") and set(fid["texts"]) == {"gpl3", "sedfaq", "pydoc"}
    row = fid["texts"]["sedfaq"]["rows"][0]
    assert row["kind"] == "dictionary" and row["name"] == fid["default"] and len(row["ci95"]) == 2


def test_failed_gate_is_written_and_refused(smoke_runs):
    out, _, bad = smoke_runs
    assert bad == 1
    assert A.read_header(out / "bad.q42art").passed is False
    before = runtime.snapshot()
    with pytest.raises(E.NotCertifiedError):
        runtime.load_certified(out / "bad.q42art")
    assert runtime.snapshot() is before
