"""The runtime switch behaves as the seed says, including every no-op case."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvdict_vk import artifact as A
from kvdict_vk import codec, errors as E, runtime

from kvdict_vk.metrics import nmse

from helpers import toy_artifact, toy_cert


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
    runtime.enable(art, allow_uncertified=True)
    assert runtime.dict_active() and runtime.installed_cert() is None
    runtime.deactivate()
    runtime.install_from_cbor(A.payload_to_cbor(art), allow_uncertified=True)
    assert runtime.installed_meta() == (4, 16) and not runtime.dict_active()
    before = runtime.snapshot()
    with pytest.raises(E.CborError):
        runtime.install_from_cbor(b"\xff\x00", allow_uncertified=True)
    with pytest.raises(E.SchemaError):
        runtime.enable("not an artifact", allow_uncertified=True)
    assert runtime.snapshot() is before


@pytest.mark.parametrize("door", ["install", "install_from_cbor", "enable", "enabled_with"])
def test_uncertified_door_needs_consent(art_file, door):
    """Every way in that carries no certificate refuses without allow_uncertified=True,
    with a typed error (a NotCertifiedError), and changes nothing."""
    p, art = art_file
    runtime.activate(p)
    before = runtime.snapshot()
    calls = {"install": lambda: runtime.install(art),
             "install_from_cbor": lambda: runtime.install_from_cbor(A.payload_to_cbor(art)),
             "enable": lambda: runtime.enable(art),
             "enabled_with": lambda: runtime.enabled_with(art).__enter__()}
    with pytest.raises(E.UncertifiedError, match="allow_uncertified=True") as refused:
        calls[door]()
    assert isinstance(refused.value, E.NotCertifiedError)
    assert runtime.snapshot() is before
    assert runtime.installed_cert() is not None and runtime.installed_cert().passed


def test_restore_brings_back_a_snapshot(art_file):
    p, art = art_file
    cert = runtime.activate(p)
    saved = runtime.snapshot()
    runtime.deactivate()
    runtime.install(toy_artifact(np.random.default_rng(1)), allow_uncertified=True)
    runtime.restore(saved)
    now = runtime.snapshot()
    assert (now.enabled, now.artifact, now.cert) == (True, saved.artifact, saved.cert)
    assert now.generation > saved.generation and runtime.installed_cert().value == cert.value
    with pytest.raises(E.SchemaError):
        runtime.restore(art)


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


def decoded_by_definition(slot, d, head: int) -> np.ndarray:
    """One slot decoded from docs/FORMAT.md with plain Python integers — no codec call:
    x = mean + Σ coef·atom[idx] + (level − (2^b − 1)/2)·Δ·scale, levels read off the
    little-endian bitstream one element at a time."""
    g = head if d.n_heads > 1 else 0
    x = np.zeros(d.head_dim) if d.mean is None else d.mean[g].astype(np.float64)
    for word in map(int, slot[:d.sparsity]):
        idx, coef = word & 0xFFFF, float(np.array(word >> 16, np.uint16).view(np.float16))
        if idx < d.n_atoms:
            x = x + coef * d.atoms[g, idx].astype(np.float64)
    b = d.residual_bits
    if b:
        stream = sum(int(w) << (32 * j) for j, w in enumerate(slot[d.sparsity:-1]))
        step = float(np.array(slot[-1], np.uint32).view(np.float32))
        levels = np.array([(stream >> (e * b)) & ((1 << b) - 1) for e in range(d.head_dim)])
        x = x + (levels - ((1 << b) - 1) / 2) * step * d.residual_scale[g].astype(np.float64)
    return x


def test_reconstruct_kv_in_place(art_file):
    """reconstruct_kv rewrites exactly n_kv head vectors of the [token][head][dim] buffer
    with what their code decodes to, and the code is OMP's: on the atoms it picked, the
    coefficients are the least-squares fit in the stream's metric (up to binary16)."""
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
    assert d.metric is not None  # toy_artifact: layer 0's K is fitted in a metric
    x = orig[:48].reshape(3, 16).astype(np.float64)
    slots = codec.encode(x, d)
    want = np.stack([decoded_by_definition(s, d, 0) for s in slots])
    np.testing.assert_allclose(proj[:48].reshape(3, 16), want, rtol=1e-6, atol=1e-6)
    w = d.metric.astype(np.float64)
    for row, slot in zip(x, slots):
        idx = slot[:d.sparsity] & 0xFFFF
        coef = (slot[:d.sparsity] >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
        chosen = d.atoms[0, idx].astype(np.float64)  # (s, head_dim)
        fit, *_ = np.linalg.lstsq(w @ chosen.T, w @ (row - d.mean[0]), rcond=None)
        np.testing.assert_allclose(coef, fit, rtol=2e-3, atol=2e-3)
    assert np.array_equal(proj[48:], orig[48:])  # beyond n_kv heads: untouched
    assert not np.array_equal(proj[:48], orig[:48])


def test_reconstruct_kv_turns_keys_coded_before_rope(art_file):
    """With an artifact whose keys are coded before RoPE, reconstruct_kv takes the first token's
    position: keys come back as the arena holds them (turned back, coded, turned again); without
    one it refuses, the buffer untouched; values need none."""
    import dataclasses

    from kvdict_vk.rope import KeyRope
    _, art = art_file
    art = dataclasses.replace(art, key_rope=KeyRope(10000.0, 16))
    rng = np.random.default_rng(6)
    n_kv, n_tok, t0 = 2, 5, 300
    k = rng.standard_normal((n_tok, n_kv, 16)).astype(np.float32)  # [token][kv head][dim]
    runtime.enable(art, allow_uncertified=True)
    proj = k.copy()
    with pytest.raises(E.ShapeError, match="t0"):
        runtime.reconstruct_kv(0, True, proj, n_kv, n_tokens=n_tok)
    assert np.array_equal(proj, k)
    assert runtime.reconstruct_kv(0, True, proj, n_kv, n_tokens=n_tok, t0=t0)
    d, x = art.layers[0][0], k.transpose(1, 0, 2)
    want = art.key_rope.rotate(codec.decode_heads(codec.encode_heads(art.key_rope.unturn(x, t0), d), d), t0)
    assert nmse(want, proj.transpose(1, 0, 2)) <= 1e-12
    assert nmse(x, proj.transpose(1, 0, 2)) > 1e-4  # it was coded
    v = k.copy()
    assert runtime.reconstruct_kv(0, False, v, n_kv, n_tokens=n_tok)  # values: no position needed
    assert nmse(codec.roundtrip_heads(x, art.layers[0][1]), v.transpose(1, 0, 2)) <= 1e-12


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
            want = np.stack([decoded_by_definition(s, k, h) for s in codec.encode(x[:, h], k, h)])
            np.testing.assert_allclose(proj[:, h], want, rtol=1e-5, atol=1e-5)
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
    with runtime.enabled_with(other, allow_uncertified=True):
        assert runtime.dict_active() and runtime.snapshot().artifact is other
    after = runtime.snapshot()
    assert (after.enabled, after.artifact, after.cert) == (before.enabled, before.artifact, before.cert)
    assert after.generation > before.generation
    try:
        with runtime.enabled_with(other, allow_uncertified=True):
            raise KeyError("boom")
    except KeyError:
        pass
    assert runtime.snapshot().artifact is before.artifact and not runtime.is_enabled()
