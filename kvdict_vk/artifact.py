"""The `.q42art` artifact format: the ONE place that knows it (writer and reader).

Byte-level description: docs/FORMAT.md. In short::

    frame   (20 bytes)  magic[8] | frame_version u16 | flags u16 | header_len u32 | header_crc32 u32
    header  (CBOR map)  kind, passed, gate{...}, payload{length, sha256}, model{...}, producer{...}
    payload (CBOR map)  KvDictArtifact: format_version, n_layers, head_dim, n_atoms, sparsity,
                        layers[{k: dict|null, v: dict|null}], window?{sink, recent},
                        key_rope?{theta, dims},
                        dict = {atoms, mean?, metric?, sparsity?, residual_bits?, residual_scale?}

Arrays are RFC 8746 typed arrays: tag 40 [shape, tag 85 (float32 little-endian bytes)].

Reading is fail-closed and staged so that nothing large is allocated before it is known
to fit: file size → frame → header (≤ 1 MiB, CRC-checked) → declared payload length →
payload bytes → SHA-256 → strict CBOR decode (depth, duplicate keys, indefinite lengths,
trailing bytes) → schema and dims. Every failure is its own :mod:`kvdict_vk.errors` class.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import cbor2
import numpy as np

from . import errors as E
from .dictionary import KvDictArtifact, StreamDict, MAX_N_ATOMS
from .rope import KeyRope
from .window import NO_WINDOW, ExactWindow

MAGIC = b"\x89Q42\r\n\x1a\n"  # PNG-style: high bit, CRLF, ^Z, LF catch text-mode mangling
FRAME = struct.Struct("<8sHHII")  # magic, frame_version, flags, header_len, header_crc32
FRAME_VERSION = 1
PAYLOAD_FORMAT_VERSION = 3
# what each payload format version added: named when an older payload is refused
_VERSION_CHANGES = {2: "the dictionary cache's exact window", 3: "keys coded before RoPE"}
KIND = "KvDictionary"
TAG_NDARRAY = 40  # RFC 8746 multi-dimensional array, row-major: [shape, typed array]
TAG_F32LE = 85  # RFC 8746 typed array: IEEE-754 binary32, little-endian

_CBOR_OPTS = dict(max_depth=8, allow_indefinite=False, allow_duplicate_keys=False,
                  strict_hashable_types=True)


@dataclass(frozen=True)
class Limits:
    """Refuse anything larger before allocating it."""
    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 4 << 30
    max_layers: int = 1024
    max_head_dim: int = 1024


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class CertInfo:
    """What `load_certified` returns: the gate numbers the artifact was certified at."""
    kind: str
    passed: bool
    metric: str
    value: float  # the gated quantity, e.g. relative ΔPPL (0.004 = +0.4 %)
    threshold: float
    baseline_ppl: float
    coded_ppl: float
    eval_tokens: int
    eval_text_sha256: str
    payload_sha256: str
    model: dict = field(default_factory=dict)
    producer: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # optional gate fields (ci95, windows, ...)

    def to_header(self, payload_len: int) -> dict:
        gate = dict(metric=self.metric, value=float(self.value), threshold=float(self.threshold),
                    baseline_ppl=float(self.baseline_ppl), coded_ppl=float(self.coded_ppl),
                    eval_tokens=int(self.eval_tokens), eval_text_sha256=self.eval_text_sha256)
        gate.update(self.extra)
        return dict(kind=self.kind, passed=bool(self.passed), gate=gate,
                    payload=dict(length=payload_len, sha256=bytes.fromhex(self.payload_sha256)),
                    model=dict(self.model), producer=dict(self.producer))


# --- CBOR helpers ---------------------------------------------------------------------

def _encode_array(a: np.ndarray) -> cbor2.CBORTag:
    a = np.ascontiguousarray(a, dtype="<f4")
    return cbor2.CBORTag(TAG_NDARRAY, [list(a.shape), cbor2.CBORTag(TAG_F32LE, a.tobytes())])


def _tag_hook(tag: cbor2.CBORTag, _immutable: bool) -> Any:
    if tag.tag == TAG_F32LE:
        if not isinstance(tag.value, bytes) or len(tag.value) % 4:
            raise E.TypedArrayError("tag 85 must hold a byte string of whole float32 values")
        return np.frombuffer(tag.value, dtype="<f4")  # read-only view, no copy
    if tag.tag == TAG_NDARRAY:
        v = tag.value
        if not (isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[1], np.ndarray)
                and isinstance(v[0], (list, tuple)) and 1 <= len(v[0]) <= 3
                and all(type(n) is int and 0 <= n for n in v[0])):
            raise E.TypedArrayError("tag 40 must be [shape (1-3 ints), tag-85 float32 array]")
        shape = tuple(v[0])
        if int(np.prod(shape, dtype=np.int64)) != v[1].size:
            raise E.TypedArrayError(f"typed array of {v[1].size} values declared shape {shape}")
        return v[1].reshape(shape)
    raise E.TypedArrayError(f"unexpected CBOR tag {tag.tag} (only 40 and 85 are allowed)")


def _decode(data: bytes, what: str) -> Any:
    fp = io.BytesIO(data)
    try:
        obj = cbor2.CBORDecoder(fp, tag_hook=_tag_hook, **_CBOR_OPTS).decode()
    except E.KvDictError:
        raise
    except Exception as e:  # cbor2 raises CBORDecodeError, sometimes wrapping ours
        cause = e.__cause__
        if isinstance(cause, E.KvDictError):
            raise cause from None
        raise E.CborError(f"{what}: malformed CBOR: {e}") from None
    if fp.tell() != len(data):
        raise E.CborError(f"{what}: {len(data) - fp.tell()} trailing bytes after the CBOR item")
    return obj


def _get(m: dict, key: str, typ, where: str, err=E.HeaderError):
    if key not in m:
        raise err(f"{where}: missing field '{key}'")
    v = m[key]
    ok = isinstance(v, typ) and not (typ in (int, (int, float)) and isinstance(v, bool))
    if not ok:
        raise err(f"{where}: field '{key}' has type {type(v).__name__}")
    return v


# --- payload: KvDictArtifact <-> CBOR --------------------------------------------------

def payload_to_cbor(art: KvDictArtifact) -> bytes:
    def enc(d: StreamDict | None):
        if d is None:
            return None
        shared = d.n_heads == 1  # written 2-D / 1-D, as a reader would expect
        m = {"atoms": _encode_array(d.atoms[0] if shared else d.atoms)}
        if d.mean is not None:
            m["mean"] = _encode_array(d.mean[0] if shared else d.mean)
        if d.metric is not None:
            m["metric"] = _encode_array(d.metric)
        if d.sparsity != art.sparsity:
            m["sparsity"] = d.sparsity
        if d.residual_bits:
            m["residual_bits"] = d.residual_bits
            m["residual_scale"] = _encode_array(d.residual_scale[0] if shared else d.residual_scale)
        return m
    m = {
        "format_version": PAYLOAD_FORMAT_VERSION, "n_layers": art.n_layers,
        "head_dim": art.head_dim, "n_atoms": art.n_atoms, "sparsity": art.sparsity,
        "layers": [{"k": enc(k), "v": enc(v)} for k, v in art.layers],
    }
    if art.window:  # absent = no window: one encoding per artifact
        m["window"] = {"sink": art.window.sink, "recent": art.window.recent}
    if art.key_rope is not None:  # absent = keys coded after RoPE
        m["key_rope"] = art.key_rope.to_dict()
    return cbor2.dumps(m)


_PAYLOAD_KEYS = {"format_version", "n_layers", "head_dim", "n_atoms", "sparsity", "layers"}
_PAYLOAD_OPTIONAL = {"window", "key_rope"}
_WINDOW_KEYS = {"sink", "recent"}
_ROPE_KEYS = {"theta", "dims"}
_DICT_KEYS = {"atoms", "mean", "metric", "sparsity", "residual_bits", "residual_scale"}
_DICT_ARRAYS = ("atoms", "mean", "metric", "residual_scale")
# Array ranks per key: atoms (n_heads, n_atoms, head_dim) or shared (n_atoms, head_dim);
# mean and residual_scale (n_heads, head_dim) or shared (head_dim,); metric 2-D.
_RANKS = {"atoms": (2, 3), "mean": (1, 2), "metric": (2,), "residual_scale": (1, 2)}


def payload_from_cbor(data: bytes, limits: Limits = DEFAULT_LIMITS) -> KvDictArtifact:
    """Decode and validate a payload (the bytes after the header). Raises SchemaError & co."""
    if len(data) > limits.max_payload_bytes:
        raise E.SizeLimitError(f"payload of {len(data)} bytes exceeds {limits.max_payload_bytes}")
    m = _decode(data, "payload")
    S = E.SchemaError
    if not isinstance(m, dict):
        raise S("payload is not a CBOR map")
    # the version first: it decides the schema the other keys are read by
    _check_format_version(_get(m, "format_version", int, "payload", S))
    if not _PAYLOAD_KEYS <= set(m) <= _PAYLOAD_KEYS | _PAYLOAD_OPTIONAL:
        raise S(f"payload keys {sorted(map(str, m))}: required {sorted(_PAYLOAD_KEYS)}, "
                f"optional {sorted(_PAYLOAD_OPTIONAL)}")
    n_layers = _get(m, "n_layers", int, "payload", S)
    head_dim = _get(m, "head_dim", int, "payload", S)
    n_atoms = _get(m, "n_atoms", int, "payload", S)
    sparsity = _get(m, "sparsity", int, "payload", S)
    if not 1 <= n_layers <= limits.max_layers:
        raise E.DimsError(f"n_layers {n_layers} outside 1..{limits.max_layers}")
    if not 1 <= head_dim <= limits.max_head_dim:
        raise E.DimsError(f"head_dim {head_dim} outside 1..{limits.max_head_dim}")
    if not 1 <= n_atoms <= MAX_N_ATOMS:
        raise E.DimsError(f"n_atoms {n_atoms} outside 1..{MAX_N_ATOMS}")
    layers_in = _get(m, "layers", list, "payload", S)
    if len(layers_in) != n_layers:
        raise E.DimsError(f"payload lists {len(layers_in)} layers, declares n_layers={n_layers}")

    def dec(d, where):
        if d is None:
            return None
        if not isinstance(d, dict) or "atoms" not in d or not set(d) <= _DICT_KEYS:
            raise S(f"{where}: a dictionary is a map with 'atoms' and optional {sorted(_DICT_KEYS - {'atoms'})}")
        arrays = {}
        for key in _DICT_ARRAYS:
            if key in d and not isinstance(d[key], np.ndarray):
                raise E.TypedArrayError(f"{where}.{key} is not a tag-40/85 float32 typed array")
            if key in d and d[key].ndim not in _RANKS[key]:
                raise E.DimsError(f"{where}.{key} has rank {d[key].ndim}, expected one of {_RANKS[key]}")
            arrays[key] = d.get(key)
        s = d.get("sparsity", sparsity)
        bits = d.get("residual_bits", 0)
        if type(s) is not int or type(bits) is not int:
            raise S(f"{where}: sparsity and residual_bits must be integers")
        a, m_, sc = arrays["atoms"], arrays["mean"], arrays["residual_scale"]
        for name, arr in (("mean", m_), ("residual_scale", sc)):  # per-head iff atoms are
            if arr is not None and arr.ndim != a.ndim - 1:
                raise E.DimsError(f"{where}.{name} rank {arr.ndim} does not match atoms rank {a.ndim}")
        return StreamDict(a, m_, arrays["metric"], s, bits, sc, where=where)

    layers = []
    for i, ent in enumerate(layers_in):
        if not isinstance(ent, dict) or set(ent) != {"k", "v"}:
            raise S(f"layers[{i}] must be a map with exactly the keys 'k' and 'v'")
        layers.append((dec(ent["k"], f"layers[{i}].k"), dec(ent["v"], f"layers[{i}].v")))
    return KvDictArtifact(head_dim=head_dim, n_atoms=n_atoms, sparsity=sparsity, layers=tuple(layers),
                          window=_window_from_cbor(m["window"]) if "window" in m else NO_WINDOW,
                          key_rope=_rope_from_cbor(m["key_rope"]) if "key_rope" in m else None)


def _check_format_version(ver: int) -> None:
    if ver < 1:
        raise E.SchemaError(f"payload format_version {ver} is not a format version")
    if ver < PAYLOAD_FORMAT_VERSION:
        changed = "; ".join(_VERSION_CHANGES[v] for v in range(ver + 1, PAYLOAD_FORMAT_VERSION + 1))
        raise E.FormatVersionError(
            f"payload format_version {ver} is older than this reader's {PAYLOAD_FORMAT_VERSION} "
            f"({changed}, docs/FORMAT.md): forge the artifact again with kvdict-forge")
    if ver > PAYLOAD_FORMAT_VERSION:
        raise E.FormatVersionError(
            f"payload format_version {ver} is newer than this reader's {PAYLOAD_FORMAT_VERSION}: "
            "read it with the kvdict_vk that wrote it, or a newer one")


def _window_from_cbor(w) -> ExactWindow:
    if not isinstance(w, dict) or set(w) != _WINDOW_KEYS:
        raise E.SchemaError("payload.window must be a map with exactly the keys 'recent' and 'sink'")
    if any(type(w[k]) is not int for k in _WINDOW_KEYS):
        raise E.SchemaError("payload.window: sink and recent must be unsigned integers")
    window = ExactWindow(w["sink"], w["recent"])  # DimsError outside its ranges
    if not window:
        raise E.SchemaError("payload.window is empty: an artifact without a window leaves the key out")
    return window


def _rope_from_cbor(r) -> KeyRope:
    if not isinstance(r, dict) or set(r) != _ROPE_KEYS:
        raise E.SchemaError("payload.key_rope must be a map with exactly the keys 'dims' and 'theta'")
    if type(r["dims"]) is not int or type(r["theta"]) not in (int, float):
        raise E.SchemaError("payload.key_rope: dims must be an unsigned integer and theta a number")
    return KeyRope(r["theta"], r["dims"])  # DimsError outside its ranges


# --- header ---------------------------------------------------------------------------

_GATE_REQUIRED = {"metric": str, "value": (int, float), "threshold": (int, float),
                  "baseline_ppl": (int, float), "coded_ppl": (int, float),
                  "eval_tokens": int, "eval_text_sha256": str}
_MODEL_REQUIRED = ("n_layers", "n_kv_heads", "head_dim")


def _parse_header(h: Any) -> tuple[CertInfo, int, bytes]:
    if not isinstance(h, dict):
        raise E.HeaderError("header is not a CBOR map")
    kind = _get(h, "kind", str, "header")
    passed = _get(h, "passed", bool, "header")
    gate = _get(h, "gate", dict, "header")
    vals = {k: _get(gate, k, t, "header.gate") for k, t in _GATE_REQUIRED.items()}
    for k in ("value", "threshold", "baseline_ppl", "coded_ppl"):
        vals[k] = float(vals[k])
        if not np.isfinite(vals[k]):
            raise E.HeaderError(f"header.gate.{k} is not finite")
    pl = _get(h, "payload", dict, "header")
    length = _get(pl, "length", int, "header.payload")
    digest = _get(pl, "sha256", bytes, "header.payload")
    if length < 0 or len(digest) != 32:
        raise E.HeaderError("header.payload: length < 0 or sha256 not 32 bytes")
    model = _get(h, "model", dict, "header")
    for k in _MODEL_REQUIRED:
        if _get(model, k, int, "header.model") < 1:
            raise E.HeaderError(f"header.model.{k} must be >= 1")
    producer = _get(h, "producer", dict, "header")
    extra = {k: v for k, v in gate.items() if k not in _GATE_REQUIRED}
    info = CertInfo(kind=kind, passed=passed, **vals, payload_sha256=digest.hex(),
                    model=model, producer=producer, extra=extra)
    return info, length, digest


# --- file I/O ---------------------------------------------------------------------------

def encode_file(art: KvDictArtifact, cert: CertInfo) -> bytes:
    """The whole framed file as bytes. The header's payload length and hash come from
    the payload itself (cert.payload_sha256 is ignored and recomputed)."""
    payload = payload_to_cbor(art)
    digest = hashlib.sha256(payload).hexdigest()
    cert = CertInfo(**{**cert.__dict__, "payload_sha256": digest})
    header = cbor2.dumps(cert.to_header(len(payload)))
    frame = FRAME.pack(MAGIC, FRAME_VERSION, 0, len(header), zlib.crc32(header))
    return frame + header + payload


def write_artifact(path: str | os.PathLike, art: KvDictArtifact, cert: CertInfo) -> CertInfo:
    """Write atomically (temp file + rename) and return the CertInfo as recorded."""
    data = encode_file(art, cert)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return read_header_bytes(data)[0]


def _check_frame(frame: bytes, file_size: int, limits: Limits) -> tuple[int, int]:
    if len(frame) < FRAME.size:
        raise E.FrameError(f"file of {file_size} bytes is shorter than the {FRAME.size}-byte frame")
    magic, version, flags, hlen, crc = FRAME.unpack(frame[:FRAME.size])
    if magic != MAGIC:
        hint = ""
        if magic[1:4] == MAGIC[1:4]:
            hint = " (it looks mangled by a text-mode transfer: line endings or the high bit)"
        raise E.FrameError(f"bad magic {magic!r}, expected {MAGIC!r}{hint}")
    if version != FRAME_VERSION:
        raise E.FrameError(f"frame version {version} not supported (this reader: {FRAME_VERSION})")
    if flags != 0:
        raise E.FrameError(f"frame flags {flags:#06x} set; none are defined")
    if hlen > limits.max_header_bytes:
        raise E.SizeLimitError(f"header length {hlen} exceeds the limit {limits.max_header_bytes}")
    if FRAME.size + hlen > file_size:
        raise E.FrameError(f"header length {hlen} runs past the end of the {file_size}-byte file")
    return hlen, crc


def read_header_bytes(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[CertInfo, int, int]:
    """(CertInfo, header_len, payload_len declared) from the leading bytes of a file."""
    hlen, crc = _check_frame(data[:FRAME.size], len(data), limits)
    header = data[FRAME.size:FRAME.size + hlen]
    if zlib.crc32(header) != crc:
        raise E.FrameError("header CRC-32 mismatch: the header was altered or truncated")
    info, length, _ = _parse_header(_decode(header, "header"))
    return info, hlen, length


def read_artifact(path: str | os.PathLike, *, require_certified: bool = True,
                  limits: Limits = DEFAULT_LIMITS) -> tuple[CertInfo, KvDictArtifact]:
    """Read and fully verify a framed artifact. With require_certified (the engine's only
    mode) the kind must be KvDictionary and passed must be true."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not (st.st_mode & 0o170000 == 0o100000):
                raise E.ArtifactIOError(f"{path}: not a regular file")
            size = st.st_size
            if size > FRAME.size + limits.max_header_bytes + limits.max_payload_bytes:
                raise E.SizeLimitError(f"{path}: file of {size} bytes exceeds the size limits")
            frame = f.read(FRAME.size)
            hlen, _ = _check_frame(frame, size, limits)
            head = frame + f.read(hlen)
            info, hlen, length = read_header_bytes(head, limits)
            if info.kind != KIND:
                raise E.WrongKindError(f"{path}: kind is '{info.kind}', expected '{KIND}'")
            if require_certified and info.passed is not True:
                raise E.NotCertifiedError(
                    f"{path}: did not pass its gate ({info.metric} = {info.value:+.4g}, "
                    f"threshold {info.threshold:+.4g}); the engine runs certified artifacts only")
            actual = size - FRAME.size - hlen
            if length > limits.max_payload_bytes:
                raise E.SizeLimitError(f"{path}: declared payload of {length} bytes exceeds the limit")
            if actual != length:
                raise E.PayloadLengthError(f"{path}: payload is {actual} bytes, header declares {length}")
            payload = f.read(length)
    except OSError as e:
        raise E.ArtifactIOError(f"{path}: {e.strerror or e}") from None
    if len(payload) != length:
        raise E.PayloadLengthError(f"{path}: file changed while being read")
    if hashlib.sha256(payload).hexdigest() != info.payload_sha256:
        raise E.PayloadHashError(f"{path}: payload SHA-256 differs from the header's")
    art = payload_from_cbor(payload, limits)
    model = info.model
    if art.n_heads not in (1, model["n_kv_heads"]):
        raise E.DimsError(f"{path}: dictionaries have {art.n_heads} heads; the model has "
                          f"{model['n_kv_heads']} KV heads (expected 1 = shared, or one per KV head)")
    if model["n_layers"] != art.n_layers or model["head_dim"] != art.head_dim:
        raise E.DimsError(
            f"{path}: header model dims (n_layers={model['n_layers']}, head_dim={model['head_dim']}) "
            f"disagree with the payload (n_layers={art.n_layers}, head_dim={art.head_dim})")
    return info, art


def read_header(path: str | os.PathLike, limits: Limits = DEFAULT_LIMITS) -> CertInfo:
    """Only the frame and header (for tools that show an artifact without loading it)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            frame = f.read(FRAME.size)
            hlen, _ = _check_frame(frame, size, limits)
            return read_header_bytes(frame + f.read(hlen), limits)[0]
    except OSError as e:
        raise E.ArtifactIOError(f"{path}: {e.strerror or e}") from None
