"""Property-based fuzzing of the loader: arbitrary CBOR in every slot of the header and
payload (valid frame, CRC and hash, so the deep checks are reached), random splices,
and a bound on memory: whatever a file declares, reading it never allocates much more
than the file itself. (tools/fuzz_loader.py runs a longer coverage-guided campaign.)"""
from __future__ import annotations

import dataclasses
import tracemalloc

import cbor2
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from kvdict_vk import artifact as A
from kvdict_vk import errors as E
from kvdict_vk import runtime
from kvdict_vk.rope import KeyRope
from kvdict_vk.window import ExactWindow

from helpers import file_with_payload, frame, header_for, toy_artifact, toy_cert

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
         | st.text(max_size=8) | st.binary(max_size=16)
         | st.sampled_from(["KvDictionary", "atoms", "mean", "k", "v"]))
_tags = st.builds(cbor2.CBORTag, st.sampled_from([40, 85, 86, 0, 1, 2, 24, 55799]), _leaf)
cbor_values = st.recursive(_leaf | _tags, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=6) | st.sampled_from(
                               ["k", "v", "atoms", "layers", "sparsity", "n_atoms", "sink", "recent"]),
                                             kids, max_size=4)
                           | st.builds(cbor2.CBORTag, st.sampled_from([40, 85]), kids), max_leaves=12)

_GOOD = None


def _good():
    global _GOOD
    if _GOOD is None:
        art = toy_artifact(np.random.default_rng(2), n_layers=2, n_atoms=8, head_dim=4, s=2, passthrough=())
        # so the window's and the key rotation's slots exist
        art = dataclasses.replace(art, window=ExactWindow(1, 4), key_rope=KeyRope(10000.0, 4))
        _GOOD = (art, toy_cert(art), cbor2.loads(A.payload_to_cbor(art)))
    return _GOOD


def _load(tmp_path, data: bytes):
    """Either a valid load or a typed ArtifactError; never anything else; state intact."""
    p = tmp_path / "f.q42art"
    p.write_bytes(data)
    before = runtime.snapshot()
    try:
        runtime.load_certified(p)
    except E.ArtifactError:
        assert runtime.snapshot() is before
        return False
    runtime.clear()
    return True


def _set_path(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


_PAYLOAD_SLOTS = [("format_version",), ("n_layers",), ("head_dim",), ("n_atoms",), ("sparsity",),
                  ("layers",), ("layers", 0), ("layers", 0, "k"), ("layers", 1, "v"),
                  ("layers", 0, "k", "atoms"), ("layers", 0, "k", "mean"),
                  ("layers", 0, "k", "sparsity"), ("layers", 1, "v", "metric"), ("window",),
                  ("window", "sink"), ("window", "recent"), ("window", "extra"),
                  ("key_rope",), ("key_rope", "theta"), ("key_rope", "dims"), ("extra",)]


@FUZZ
@given(slot=st.sampled_from(_PAYLOAD_SLOTS), value=cbor_values)
def test_payload_type_confusion(tmp_path, slot, value):
    art, cert, _ = _good()
    p = cbor2.loads(A.payload_to_cbor(art))  # a fresh, mutable copy
    _set_path(p, slot, value)
    _load(tmp_path, file_with_payload(cbor2.dumps(p), cert))


_HEADER_SLOTS = [("kind",), ("passed",), ("gate",), ("gate", "value"), ("gate", "eval_tokens"),
                 ("payload",), ("payload", "length"), ("model",), ("model", "n_layers"),
                 ("producer",), ("extra",)]


@FUZZ
@given(slot=st.sampled_from(_HEADER_SLOTS), value=cbor_values)
def test_header_type_confusion(tmp_path, slot, value):
    art, cert, raw = _good()
    payload = cbor2.dumps(raw)
    h = cbor2.loads(header_for(payload, cert))
    _set_path(h, slot, value)
    _load(tmp_path, frame(cbor2.dumps(h), payload))


@FUZZ
@given(junk=st.binary(max_size=300), where=st.integers(0, 10**6), mode=st.sampled_from(["insert", "replace"]))
def test_random_splices(tmp_path, junk, where, mode):
    art, cert, _ = _good()
    data = A.encode_file(art, cert)
    w = where % (len(data) + 1)
    data = data[:w] + junk + data[w + (len(junk) if mode == "replace" else 0):]
    _load(tmp_path, data)


@FUZZ
@given(payload=cbor_values)
def test_arbitrary_payload_with_valid_hash(tmp_path, payload):
    _, cert, _ = _good()
    assert not _load(tmp_path, file_with_payload(cbor2.dumps(payload), cert))


def _peak_bytes(path) -> int:
    tracemalloc.start()
    try:
        A.read_artifact(path)
    except E.ArtifactError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_memory_bounded_by_file_size(tmp_path):
    art, cert, raw = _good()
    margin = 1 << 20
    hostile = {
        "huge_bytes": b"\x5b" + (1 << 40).to_bytes(8, "big") + b"x" * 1000,
        "huge_array": b"\x9b" + (1 << 40).to_bytes(8, "big") + b"\x00" * 1000,
        "huge_map": b"\xbb" + (1 << 40).to_bytes(8, "big") + b"\x00" * 1000,
        "huge_shape": cbor2.dumps({**raw, "layers": [{"k": cbor2.CBORTag(40, [[1 << 31, 1 << 31], cbor2.CBORTag(85, b"")]), "v": None}] * 2}),
        "many_small": cbor2.dumps([[0] * 50] * 2000),
    }
    for name, payload in hostile.items():
        p = tmp_path / f"{name}.q42art"
        p.write_bytes(file_with_payload(payload, cert))
        size = p.stat().st_size
        assert _peak_bytes(p) < 4 * size + margin, name
    # A legitimate 4 MiB artifact: decoded arrays are views of the payload, not copies.
    big = toy_artifact(np.random.default_rng(0), n_layers=8, n_atoms=1024, head_dim=64, s=8, passthrough=())
    p = tmp_path / "big.q42art"
    A.write_artifact(p, big, toy_cert(big))
    size = p.stat().st_size
    assert size > 4 << 20
    assert _peak_bytes(p) < 2.5 * size + margin
