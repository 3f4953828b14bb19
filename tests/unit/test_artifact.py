"""The .q42art format: round trips, and every corruption class refused with its own
typed error while the installed runtime state stays exactly as it was."""
from __future__ import annotations

import copy
import dataclasses

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvdict_vk import artifact as A
from kvdict_vk import errors as E
from kvdict_vk import runtime
from kvdict_vk.dictionary import KvDictArtifact, StreamDict
from kvdict_vk.rope import KeyRope
from kvdict_vk.window import NO_WINDOW, ExactWindow

from helpers import file_with_payload, frame, header_for, toy_artifact, toy_cert

HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good():
    rng = np.random.default_rng(7)
    art = toy_artifact(rng)
    cert = toy_cert(art)
    return art, cert, A.encode_file(art, cert)


@pytest.fixture
def installed(tmp_path):
    """A known state installed before each corruption test; returns the snapshot."""
    rng = np.random.default_rng(1)
    art = toy_artifact(rng, n_layers=2)
    p = tmp_path / "prior.q42art"
    A.write_artifact(p, art, toy_cert(art))
    runtime.activate(p)
    yield runtime.snapshot()
    runtime.deactivate()


def _refused(tmp_path, data: bytes, exc, match=None):
    p = tmp_path / "bad.q42art"
    p.write_bytes(data)
    before = runtime.snapshot()
    with pytest.raises(exc, match=match):
        runtime.load_certified(p)
    with pytest.raises(exc):
        runtime.activate(p)
    assert runtime.snapshot() is before, "a refused artifact changed the installed state"


# --- round trips ----------------------------------------------------------------------------

def test_round_trip_preserves_everything(tmp_path, good):
    art, cert, _ = good
    p = tmp_path / "a.q42art"
    A.write_artifact(p, art, cert)
    info, back = A.read_artifact(p)
    assert info.passed and info.kind == A.KIND and info.value == cert.value
    assert info.model["n_kv_heads"] == 2 and info.producer["name"] == "tests"
    assert (back.head_dim, back.n_atoms, back.sparsity, back.n_layers) == \
           (art.head_dim, art.n_atoms, art.sparsity, art.n_layers)
    for (k0, v0), (k1, v1) in zip(art.layers, back.layers):
        for a, b in ((k0, k1), (v0, v1)):
            assert (a is None) == (b is None)
            if a is None:
                continue
            assert np.array_equal(a.atoms, b.atoms) and a.sparsity == b.sparsity
            assert a.residual_bits == b.residual_bits
            for f in ("mean", "metric", "residual_scale"):
                x, y = getattr(a, f), getattr(b, f)
                assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
            assert not b.atoms.flags.writeable


def test_arrays_are_rfc8746_typed_arrays(good):
    payload = A.payload_to_cbor(good[0])
    raw = cbor2.loads(payload)  # without our hook: raw tags
    atoms = raw["layers"][0]["k"]["atoms"]
    assert atoms.tag == 40 and list(atoms.value[0]) == [64, 16]
    assert atoms.value[1].tag == 85 and len(atoms.value[1].value) == 64 * 16 * 4


@settings(max_examples=25, deadline=None)
@given(n_layers=st.integers(1, 4), hd=st.sampled_from([1, 3, 16, 33]), n_atoms=st.integers(1, 40),
       data=st.data())
def test_round_trip_property(n_layers, hd, n_atoms, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    s = data.draw(st.integers(1, min(hd, n_atoms)))
    layers = []
    for _ in range(n_layers):
        pair = []
        for _ in range(2):
            if data.draw(st.booleans()):
                pair.append(None)
                continue
            atoms = rng.standard_normal((n_atoms, hd)).astype(np.float32) + 0.01
            pair.append(StreamDict(atoms, rng.standard_normal(hd) if data.draw(st.booleans()) else None,
                                   rng.standard_normal((hd, hd)) if data.draw(st.booleans()) else None,
                                   data.draw(st.integers(1, s))))
        layers.append(pair)
    art = KvDictArtifact(hd, n_atoms, s, layers)
    back = A.payload_from_cbor(A.payload_to_cbor(art))
    assert np.array_equal(back.atoms_flat(), art.atoms_flat())
    assert [[None if d is None else d.sparsity for d in p] for p in back.layers] == \
           [[None if d is None else d.sparsity for d in p] for p in art.layers]


# --- frame ----------------------------------------------------------------------------------

@HYP
@given(bit=st.integers(0, 10**9))
def test_any_single_bit_flip_is_refused(tmp_path, installed, good, bit):
    data = bytearray(good[2])
    bit %= len(data) * 8
    data[bit // 8] ^= 1 << (bit % 8)
    _refused(tmp_path, bytes(data), E.ArtifactError)


@HYP
@given(cut=st.integers(0, 10**9))
def test_any_truncation_is_refused(tmp_path, installed, good, cut):
    data = good[2]
    _refused(tmp_path, data[: cut % len(data)], E.ArtifactError)


@HYP
@given(extra=st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_refused(tmp_path, installed, good, extra):
    _refused(tmp_path, good[2] + extra, E.PayloadLengthError)


def test_text_mode_mangling_is_named(tmp_path, installed, good):
    mangled = good[2].replace(b"\r\n", b"\n", 1)
    _refused(tmp_path, mangled, E.FrameError, match="text-mode")


@pytest.mark.parametrize("field,value,exc", [
    ("version", 2, E.FrameError), ("flags", 1, E.FrameError),
    ("header_len", 1 << 30, E.SizeLimitError), ("crc", 0, E.FrameError),
])
def test_frame_fields(tmp_path, installed, good, field, value, exc):
    art, cert, _ = good
    payload = A.payload_to_cbor(art)
    _refused(tmp_path, frame(header_for(payload, cert), payload, **{field: value}), exc)


def test_header_length_past_end(tmp_path, installed, good):
    art, cert, _ = good
    payload = A.payload_to_cbor(art)
    header = header_for(payload, cert)
    _refused(tmp_path, frame(header, b"", header_len=len(header) + 10)[: 20 + len(header)], E.FrameError)


# --- header -----------------------------------------------------------------------------------

def test_wrong_kind(tmp_path, installed, good):
    art, cert, _ = good
    _refused(tmp_path, file_with_payload(A.payload_to_cbor(art), cert, kind="Tokenizer"), E.WrongKindError)


def test_not_certified(tmp_path, installed, good):
    art, cert, _ = good
    _refused(tmp_path, file_with_payload(A.payload_to_cbor(art), cert, passed=False),
             E.NotCertifiedError, match="did not pass")


def test_passed_must_be_boolean_true(tmp_path, installed, good):
    art, cert, _ = good
    _refused(tmp_path, file_with_payload(A.payload_to_cbor(art), cert, passed=1), E.HeaderError)


def test_uncertified_header_is_still_readable(tmp_path, good):
    art, cert, _ = good
    p = tmp_path / "failed.q42art"
    A.write_artifact(p, art, toy_cert(art, passed=False))
    assert A.read_header(p).passed is False
    info, _ = A.read_artifact(p, require_certified=False)
    assert info.passed is False


@pytest.mark.parametrize("mutate", [
    lambda h: h.pop("gate"), lambda h: h["gate"].pop("baseline_ppl"),
    lambda h: h["gate"].update(value="big"), lambda h: h["gate"].update(value=float("nan")),
    lambda h: h["model"].pop("head_dim"), lambda h: h["payload"].update(sha256=b"short"),
    lambda h: h.update(producer=[1]), lambda h: h["model"].update(n_kv_heads=0),
])
def test_malformed_header(tmp_path, installed, good, mutate):
    art, cert, _ = good
    payload = A.payload_to_cbor(art)
    h = cbor2.loads(header_for(payload, cert))
    mutate(h)
    _refused(tmp_path, frame(cbor2.dumps(h), payload), E.HeaderError)


def test_header_not_a_map_and_trailing_bytes(tmp_path, installed, good):
    art, cert, _ = good
    payload = A.payload_to_cbor(art)
    _refused(tmp_path, frame(cbor2.dumps([1, 2]), payload), E.HeaderError)
    _refused(tmp_path, frame(header_for(payload, cert) + b"\x00", payload), E.CborError)


def test_hash_mismatch(tmp_path, installed, good):
    art, cert, _ = good
    payload = A.payload_to_cbor(art)
    h = cbor2.loads(header_for(payload, cert))
    h["payload"]["sha256"] = bytes(32)
    _refused(tmp_path, frame(cbor2.dumps(h), payload), E.PayloadHashError)


def test_declared_length_mismatch_and_absurd(tmp_path, installed, good):
    art, cert, _ = good
    payload = A.payload_to_cbor(art)
    for length, exc in ((len(payload) - 1, E.PayloadLengthError), (1 << 50, E.SizeLimitError)):
        h = cbor2.loads(header_for(payload, cert))
        h["payload"]["length"] = length
        _refused(tmp_path, frame(cbor2.dumps(h), payload), exc)


# --- payload schema (hash recomputed, so the checks behind it are reached) --------------------------

def _raw_payload(good):
    return cbor2.loads(A.payload_to_cbor(good[0]))


def _tagged(a):
    return A._encode_array(np.asarray(a, np.float32))


@pytest.mark.parametrize("mutate,exc", [
    (lambda p: p["layers"][0]["k"].update(atoms=_tagged(np.full((64, 16), np.nan))), E.NonFiniteError),
    (lambda p: p["layers"][0]["v"].update(mean=_tagged(np.full(16, np.inf))), E.NonFiniteError),
    (lambda p: p["layers"][0]["k"].update(atoms=_tagged(np.zeros((64, 16)))), E.ZeroAtomError),
    (lambda p: p["layers"][0]["k"].update(atoms=_tagged(np.ones((64, 15)))), E.DimsError),
    (lambda p: p["layers"][0]["v"].update(metric=_tagged(np.ones((16, 3)))), E.DimsError),
    (lambda p: p.update(n_atoms=70000), E.DimsError),
    (lambda p: p.update(sparsity=0), E.DimsError),
    (lambda p: p.update(sparsity=17), E.DimsError),
    (lambda p: p["layers"][0]["k"].update(sparsity=9), E.DimsError),
    (lambda p: p.update(n_layers=4), E.DimsError),
    (lambda p: p.update(format_version=4), E.FormatVersionError),
    (lambda p: p.update(format_version=2), E.FormatVersionError),
    (lambda p: p.update(format_version=0), E.SchemaError),
    (lambda p: p.update(format_version=-1), E.SchemaError),
    (lambda p: p.update(format_version="3"), E.SchemaError),
    (lambda p: p.update(extra=1), E.SchemaError),
    (lambda p: p["layers"].__setitem__(0, {"k": None}), E.SchemaError),
    (lambda p: p["layers"][0]["k"].update(atoms=[[1.0] * 16] * 64), E.TypedArrayError),
    (lambda p: p["layers"][0]["k"].update(atoms=cbor2.CBORTag(40, [[64, 16], cbor2.CBORTag(86, b"\0" * 4096)])),
     E.TypedArrayError),
    (lambda p: p["layers"][0]["k"].update(atoms=cbor2.CBORTag(40, [[64, 17], cbor2.CBORTag(85, b"\0" * 4096)])),
     E.TypedArrayError),
    (lambda p: p["layers"][0]["k"].update(atoms=cbor2.CBORTag(85, b"\0\0\0")), E.TypedArrayError),
    (lambda p: p["layers"][0]["k"].update(atoms=cbor2.CBORTag(40, [[1 << 40, 16], cbor2.CBORTag(85, b"")])),
     E.TypedArrayError),
    (lambda p: p.update(head_dim=True), E.SchemaError),
])
def test_payload_schema(tmp_path, installed, good, mutate, exc):
    p = _raw_payload(good)
    mutate(p)
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), exc)


def test_header_and_payload_dims_must_agree(tmp_path, installed, good):
    art, cert, _ = good
    wrong = copy.deepcopy(cert.model)
    wrong["head_dim"] = 32
    cert2 = A.CertInfo(**{**cert.__dict__, "model": wrong})
    _refused(tmp_path, A.encode_file(art, cert2), E.DimsError)


@pytest.mark.parametrize("raw,exc", [
    (b"\xa2\x61a\x01\x61a\x02", E.CborError),  # duplicate keys
    (b"\x81" * 64 + b"\x01", E.CborError),  # deep nesting
    (b"\x9f\x01\xff", E.CborError),  # indefinite length
    (b"\x5b" + (1 << 40).to_bytes(8, "big") + b"abc", E.CborError),  # huge declared byte string
    (b"\x9b" + (1 << 40).to_bytes(8, "big") + b"\x01", E.CborError),  # huge declared array
    (b"\xa1\x01\x02", E.CborError),  # non-text map key
    (b"\xc1\x01", E.SchemaError),  # a date: valid CBOR, not our schema
    (cbor2.dumps({"a": 1}) + b"\x00", E.CborError),  # trailing bytes
])
def test_hostile_cbor_payloads(tmp_path, installed, good, raw, exc):
    _refused(tmp_path, file_with_payload(raw, good[1]), exc)


def test_size_limits_checked_before_reading(tmp_path, installed, good):
    p = tmp_path / "a.q42art"
    p.write_bytes(good[2])
    with pytest.raises(E.SizeLimitError):
        A.read_artifact(p, limits=A.Limits(max_payload_bytes=100))
    with pytest.raises(E.SizeLimitError):
        A.read_artifact(p, limits=A.Limits(max_header_bytes=10))


def test_missing_file_and_directory(tmp_path, installed):
    before = runtime.snapshot()
    with pytest.raises(E.ArtifactIOError):
        runtime.load_certified(tmp_path / "nope.q42art")
    with pytest.raises(E.ArtifactIOError):
        runtime.load_certified(tmp_path)
    assert runtime.snapshot() is before


def test_per_head_and_residual_round_trip(tmp_path):
    rng = np.random.default_rng(21)
    k = StreamDict(rng.standard_normal((3, 32, 8)), rng.standard_normal((3, 8)), None, 2,
                   residual_bits=3, residual_scale=rng.uniform(0.5, 1, (3, 8)))
    v = StreamDict(rng.standard_normal((3, 32, 8)), None, None, 4)
    art = KvDictArtifact(8, 32, 4, [(k, v), (None, v)])
    p = tmp_path / "ph.q42art"
    A.write_artifact(p, art, toy_cert(art, n_kv_heads=3))
    _, back = A.read_artifact(p)
    assert back.n_heads == 3 and np.array_equal(back.atoms_flat(), art.atoms_flat())
    bk = back.layers[0][0]
    assert bk.residual_bits == 3 and np.array_equal(bk.residual_scale, k.residual_scale)
    assert bk.slot_words == 2 + 1 + 1
    # per-head dictionaries must match the model's KV heads
    p2 = tmp_path / "bad.q42art"
    A.write_artifact(p2, art, toy_cert(art, n_kv_heads=2))
    with pytest.raises(E.DimsError, match="KV heads"):
        A.read_artifact(p2)


@pytest.mark.parametrize("mutate,exc", [
    (lambda d: d.update(residual_bits=3), E.SchemaError),  # bits without a scale
    (lambda d: d.update(residual_bits=9, residual_scale=_tagged(np.ones(16))), E.DimsError),
    (lambda d: d.update(residual_bits=2, residual_scale=_tagged(-np.ones(16))), E.DimsError),
    (lambda d: d.update(residual_bits=2, residual_scale=_tagged(np.ones((2, 16)))), E.DimsError),
    (lambda d: d.update(atoms=_tagged(np.ones((2, 64, 16)))), E.DimsError),  # rank 3 atoms, rank 1 mean
    (lambda d: d.update(mean=_tagged(np.ones((1, 1, 16)))), E.DimsError),
    (lambda d: d.update(residual_bits="2", residual_scale=_tagged(np.ones(16))), E.SchemaError),
])
def test_residual_and_head_schema(tmp_path, installed, good, mutate, exc):
    p = _raw_payload(good)
    mutate(p["layers"][1]["k"])
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), exc)


# --- payload format version 2: the exact window ------------------------------------------------

@pytest.mark.parametrize("window", [NO_WINDOW, ExactWindow(1, 32), ExactWindow(0, 4096), ExactWindow(256, 0)])
def test_window_round_trip(tmp_path, good, window):
    art = dataclasses.replace(good[0], window=window)
    p = tmp_path / "w.q42art"
    A.write_artifact(p, art, good[1])
    _, back = A.read_artifact(p)
    assert back.window == window and np.array_equal(back.atoms_flat(), art.atoms_flat())
    raw = cbor2.loads(A.payload_to_cbor(art))
    assert raw["format_version"] == A.PAYLOAD_FORMAT_VERSION == 3
    # written only for a window: the same dictionaries without one encode as they did
    assert raw.get("window") == ({"sink": window.sink, "recent": window.recent} if window else None)
    assert ("window" in raw) == bool(window)


def test_window_survives_f16_atoms_and_is_validated(good):
    art = dataclasses.replace(good[0], window=ExactWindow(1, 32))
    assert art.with_f16_atoms().window == ExactWindow(1, 32)
    assert good[0].window is NO_WINDOW
    with pytest.raises(E.SchemaError, match="ExactWindow"):
        dataclasses.replace(good[0], window=(1, 32))


@pytest.mark.parametrize("old", [1, 2])
def test_older_format_version_refused_naming_both(tmp_path, installed, good, old):
    assert issubclass(E.FormatVersionError, E.SchemaError)
    p = _raw_payload(good)
    p["format_version"] = old
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), E.FormatVersionError,
             match=rf"format_version {old} is older than this reader's {A.PAYLOAD_FORMAT_VERSION}.*kvdict-forge")


def test_older_format_names_what_changed_since(tmp_path, installed, good):
    p = _raw_payload(good)
    p["format_version"] = 2
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), E.FormatVersionError,
             match="keys coded before RoPE")


def test_newer_format_version_refused(tmp_path, installed, good):
    p = _raw_payload(good)
    p["format_version"] = A.PAYLOAD_FORMAT_VERSION + 1
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), E.FormatVersionError,
             match=f"{A.PAYLOAD_FORMAT_VERSION + 1} is newer than this reader's {A.PAYLOAD_FORMAT_VERSION}")


def test_version_checked_before_the_keys(tmp_path, installed, good):
    """A version-1 payload with a window (never written) is refused for its version."""
    p = _raw_payload(good)
    p.update(format_version=1, window={"sink": 1, "recent": 32})
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), E.FormatVersionError)


@pytest.mark.parametrize("window,exc", [
    ({"sink": 1, "recent": 32, "group": 1}, E.SchemaError),  # an extra key
    ({"sink": 1}, E.SchemaError),  # a missing key
    ({"sink": -1, "recent": 32}, E.DimsError),
    ({"sink": 1, "recent": -32}, E.DimsError),
    ({"sink": True, "recent": 32}, E.SchemaError),
    ({"sink": 1, "recent": False}, E.SchemaError),
    ({"sink": 1.0, "recent": 32}, E.SchemaError),
    ({"sink": "1", "recent": 32}, E.SchemaError),
    ({"sink": 257, "recent": 32}, E.DimsError),
    ({"sink": 1, "recent": 4097}, E.DimsError),
    ({"sink": 1, "recent": 1 << 70}, E.DimsError),
    ({"sink": 0, "recent": 0}, E.SchemaError),  # empty: written by leaving the key out
    ([1, 32], E.SchemaError),
    (None, E.SchemaError),
    (33, E.SchemaError),
    ({b"sink": 1, b"recent": 32}, E.SchemaError),
])
def test_malformed_window_refused(tmp_path, installed, good, window, exc):
    p = _raw_payload(good)
    p["window"] = window
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), exc)


# --- payload format version 3: keys coded before RoPE -------------------------------------------

@pytest.mark.parametrize("rope", [None, KeyRope(10000.0, 8), KeyRope(500000, 4)])
def test_key_rope_round_trip(tmp_path, good, rope):
    art = dataclasses.replace(good[0], key_rope=rope, window=ExactWindow(1, 4))
    p = tmp_path / "r.q42art"
    A.write_artifact(p, art, good[1])
    _, back = A.read_artifact(p)
    assert back.key_rope == rope and back.window == ExactWindow(1, 4)
    assert back.with_f16_atoms().key_rope == rope
    raw = cbor2.loads(A.payload_to_cbor(art))
    assert raw.get("key_rope") == (None if rope is None else {"theta": rope.theta, "dims": rope.dims})
    assert ("key_rope" in raw) == (rope is not None)
    assert back.stream_rope(1, True) == rope and back.stream_rope(1, False) is None


def test_key_rope_checked_against_head_dim(good):
    hd = good[0].head_dim
    with pytest.raises(E.DimsError, match="dims"):
        dataclasses.replace(good[0], key_rope=KeyRope(10000.0, hd + 2))
    with pytest.raises(E.SchemaError, match="KeyRope"):
        dataclasses.replace(good[0], key_rope=(10000.0, 4))


@pytest.mark.parametrize("rope,exc", [
    ({"theta": 10000.0, "dims": 4, "pairs": "adjacent"}, E.SchemaError),
    ({"theta": 10000.0}, E.SchemaError),
    ({"theta": 10000.0, "dims": 3}, E.DimsError),
    ({"theta": 10000.0, "dims": 0}, E.DimsError),
    ({"theta": 1.0, "dims": 4}, E.DimsError),
    ({"theta": float("nan"), "dims": 4}, E.DimsError),
    ({"theta": float("inf"), "dims": 4}, E.DimsError),
    ({"theta": "1e4", "dims": 4}, E.SchemaError),
    ({"theta": 10000.0, "dims": 4.0}, E.SchemaError),
    ({"theta": 10000.0, "dims": True}, E.SchemaError),
    ({"theta": 10000.0, "dims": 1 << 40}, E.DimsError),
    ([10000.0, 4], E.SchemaError),
    (None, E.SchemaError),
])
def test_malformed_key_rope_refused(tmp_path, installed, good, rope, exc):
    p = _raw_payload(good)
    p["key_rope"] = rope
    _refused(tmp_path, file_with_payload(cbor2.dumps(p), good[1]), exc)
