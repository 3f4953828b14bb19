"""The runtime switch behaves as the seed says, including every no-op case."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvdict_vk import artifact as A
from kvdict_vk import codec, errors as E, runtime

from helpers import nmse, toy_artifact, toy_cert


@pytest.fixture
def art_file(tmp_path):
    rng = np.random.default_rng(3)
    art = toy_artifact(rng, n_layers=3, n_atoms=64, head_dim=16, s=4, passthrough=((1, 1), (2, 0)))
    p = tmp_path / "t.q42art"
    A.write_artifact(p, art, toy_cert(art))
    yield p, art
    runtime.deactivate()


def test_off_by_default_and_switches(art_file):
    p, art = art_file
    runtime.deactivate()
    assert not runtime.dict_active() and not runtime.is_enabled()
    assert runtime.installed_meta() is None and runtime.sparsity() == 0
    assert runtime.atoms_flat() is None and runtime.clone_layer_dict(0, True) is None

    cert = runtime.load_certified(p)  # installs, does not toggle
    assert cert.passed and runtime.installed_meta() == (4, 16) and runtime.sparsity() == 4
    assert not runtime.dict_active()
    runtime.enable()
    assert runtime.dict_active() and runtime.is_enabled()
    runtime.disable()
    assert not runtime.dict_active() and runtime.installed_meta() == (4, 16)
    runtime.enable()
    runtime.clear()  # drops dictionaries, toggle stays on
    assert runtime.is_enabled() and not runtime.dict_active()
    assert runtime.activate(p).value == cert.value and runtime.dict_active()
    assert runtime.installed_cert().payload_sha256 == cert.payload_sha256
    runtime.deactivate()
    assert not runtime.is_enabled() and runtime.installed_meta() is None


def test_enable_with_artifact_and_install_from_cbor(art_file):
    _, art = art_file
    runtime.deactivate()
    runtime.enable(art)
    assert runtime.dict_active() and runtime.installed_cert() is None
    runtime.deactivate()
    runtime.install_from_cbor(A.payload_to_cbor(art))
    assert runtime.installed_meta() == (4, 16) and not runtime.dict_active()
    before = runtime.snapshot()
    with pytest.raises(E.CborError):
        runtime.install_from_cbor(b"\xff\x00")
    with pytest.raises(E.SchemaError):
        runtime.enable("not an artifact")
    assert runtime.snapshot() is before


def test_clone_layer_dict(art_file):
    p, art = art_file
    runtime.activate(p)
    assert runtime.clone_layer_dict(1, False) is None and runtime.clone_layer_dict(2, True) is None
    d = runtime.clone_layer_dict(0, True)
    assert d is art.layers[0][0] or np.array_equal(d.atoms, art.layers[0][0].atoms)
    assert not d.atoms.flags.writeable  # shared and immutable: "clone" costs nothing
    with pytest.raises(E.LayerIndexError):
        runtime.clone_layer_dict(3, True)


def test_atoms_flat_layout(art_file):
    p, art = art_file
    runtime.activate(p)
    flat, n_atoms, hd = runtime.atoms_flat()
    assert (n_atoms, hd) == (64, 16) and flat.dtype == np.float32
    blocks = flat.reshape(3, 2, art.n_heads, 64, 16)
    for i, pair in enumerate(art.layers):
        for j, d in enumerate(pair):
            if d is None:
                assert not blocks[i, j].any()
            else:
                assert np.array_equal(blocks[i, j], d.atoms)


def test_reconstruct_kv_in_place(art_file):
    p, art = art_file
    rng = np.random.default_rng(5)
    n_kv = 3
    proj = rng.standard_normal(n_kv * 16 + 5).astype(np.float32)  # longer than needed: fine
    orig = proj.copy()
    assert not runtime.reconstruct_kv(0, True, proj, n_kv)  # off: no-op
    assert np.array_equal(proj, orig)
    runtime.activate(p)
    assert runtime.reconstruct_kv(0, True, proj, n_kv)
    d = art.layers[0][0]
    want = codec.decode(codec.encode(orig[:48].reshape(3, 16), d), d)
    assert nmse(want, proj[:48].reshape(3, 16)) < 1e-13
    assert np.array_equal(proj[48:], orig[48:])  # beyond n_kv heads: untouched
    assert not np.array_equal(proj[:48], orig[:48])


@pytest.mark.parametrize("case", ["passthrough", "head_dim", "short", "layer"])
def test_reconstruct_kv_no_op_cases(art_file, case):
    p, _ = art_file
    runtime.activate(p)
    proj = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    layer, k_not_v = 0, True
    if case == "passthrough":
        layer, k_not_v = 1, False
    elif case == "head_dim":
        proj = np.ones((2, 8), np.float32)
    elif case == "short":
        proj = proj.reshape(-1)[:20]
    elif case == "layer":
        layer = 99
    orig = proj.copy()
    assert not runtime.reconstruct_kv(layer, k_not_v, proj, 2)
    assert np.array_equal(proj, orig)


def test_reconstruct_kv_rejects_bad_buffers(art_file):
    p, _ = art_file
    runtime.activate(p)
    with pytest.raises(E.ShapeError):
        runtime.reconstruct_kv(0, True, np.ones(32, np.float64), 2)
    ro = np.ones(32, np.float32)
    ro.flags.writeable = False
    with pytest.raises(E.ShapeError):
        runtime.reconstruct_kv(0, True, ro, 2)
    with pytest.raises(E.ShapeError):
        runtime.reconstruct_kv(0, True, np.ones((4, 16), np.float32)[::2], 2)


def _run(env_extra, code):
    import os
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_variable_activates_at_start(art_file, tmp_path):
    p, _ = art_file
    code = "from kvdict_vk import runtime as r; print(r.dict_active(), r.installed_meta())"
    out = _run({runtime.ENV_ARTIFACT: str(p)}, code)
    assert out.returncode == 0 and out.stdout.strip() == "True (4, 16)", out.stderr
    bad = tmp_path / "bad.q42art"
    bad.write_bytes(p.read_bytes()[:-1])
    out = _run({runtime.ENV_ARTIFACT: str(bad)},
               code + "; print(type(r.startup_error).__name__)")
    assert out.returncode == 0
    assert out.stdout.split("\n")[:2] == ["False None", "PayloadLengthError"]
    assert "refused" in out.stderr


def test_reconstruct_kv_per_head_residual_many_tokens(tmp_path):
    """Per-head dictionaries with a residual stage; several tokens in one call, laid out
    [token][head][dim]; each head through its own dictionary."""
    rng = np.random.default_rng(12)
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    n_kv, hd, na = 3, 16, 32
    k = StreamDict(rng.standard_normal((n_kv, na, hd)), rng.standard_normal((n_kv, hd)), None, 3,
                   residual_bits=3, residual_scale=rng.uniform(0.5, 2, (n_kv, hd)))
    art = KvDictArtifact(hd, na, 3, [(k, None)])
    p = tmp_path / "ph.q42art"
    A.write_artifact(p, art, toy_cert(art, n_kv_heads=n_kv))
    runtime.activate(p)
    try:
        x = rng.standard_normal((5, n_kv, hd)).astype(np.float32)
        proj = x.copy()
        assert runtime.reconstruct_kv(0, True, proj, n_kv, n_tokens=5)
        for h in range(n_kv):
            want = codec.decode(codec.encode(x[:, h], k, h), k, h)
            assert nmse(want, proj[:, h]) < 1e-12
        # The residual stage really works: far closer than the 3 atoms alone.
        atoms_only = np.stack([codec.reconstruct(codec.encode(x[:, h], k, h)[:, :3], k.atoms[h], k.mean[h])
                               for h in range(n_kv)], 1)
        assert nmse(x, proj) < 0.2 * nmse(x, atoms_only)
        # a per-head dictionary for 3 heads does not fit 2 heads: no-op
        two = x[:, :2].copy()
        assert not runtime.reconstruct_kv(0, True, two, 2, n_tokens=5)
        assert np.array_equal(two, x[:, :2])
    finally:
        runtime.deactivate()


def test_enabled_with_restores_the_previous_state(art_file):
    other = toy_artifact(np.random.default_rng(8))
    runtime.load_certified(art_file[0])
    runtime.disable()
    before = runtime.snapshot()
    with runtime.enabled_with(other):
        assert runtime.dict_active() and runtime.snapshot().artifact is other
    after = runtime.snapshot()
    assert (after.enabled, after.artifact, after.cert) == (before.enabled, before.artifact, before.cert)
    assert after.generation > before.generation
    try:
        with runtime.enabled_with(other):
            raise KeyError("boom")
    except KeyError:
        pass
    assert runtime.snapshot().artifact is before.artifact and not runtime.is_enabled()
