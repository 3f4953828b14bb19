"""Shared builders for tests: small random dictionaries, artifacts and framed files."""
from __future__ import annotations

import hashlib
import zlib

import cbor2
import numpy as np

from kvdict_vk import artifact as A
from kvdict_vk.dictionary import KvDictArtifact, StreamDict


def unit_atoms(rng, n_atoms, head_dim, dtype=np.float32):
    a = rng.standard_normal((n_atoms, head_dim))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    return a.astype(dtype)


def stream_dict(rng, n_atoms=64, head_dim=16, s=4, mean=True, metric=False):
    m = (rng.standard_normal(head_dim) * 0.5).astype(np.float32) if mean else None
    w = None
    if metric:
        w = (np.eye(head_dim) + 0.1 * rng.standard_normal((head_dim, head_dim))).astype(np.float32)
    return StreamDict(unit_atoms(rng, n_atoms, head_dim), m, w, s)


def toy_artifact(rng, n_layers=3, n_atoms=64, head_dim=16, s=4, passthrough=((1, 1),)):
    """passthrough: (layer, 0=K/1=V) pairs left without a dictionary."""
    layers = []
    for i in range(n_layers):
        pair = [None if (i, j) in passthrough else stream_dict(rng, n_atoms, head_dim, s,
                                                                metric=(i == 0 and j == 0))
                for j in range(2)]
        layers.append(tuple(pair))
    return KvDictArtifact(head_dim=head_dim, n_atoms=n_atoms, sparsity=s, layers=layers)


def toy_cert(art: KvDictArtifact, passed=True, kind=A.KIND, n_kv_heads=2) -> A.CertInfo:
    return A.CertInfo(kind=kind, passed=passed, metric="delta_ppl_rel", value=0.004,
                      threshold=0.01, baseline_ppl=19.82, coded_ppl=19.90, eval_tokens=7168,
                      eval_text_sha256="0" * 64, payload_sha256="",
                      model=dict(name="toy", n_layers=art.n_layers, n_kv_heads=n_kv_heads,
                                 head_dim=art.head_dim),
                      producer=dict(name="tests", version="0"))


def frame(header: bytes, payload: bytes, *, magic=A.MAGIC, version=A.FRAME_VERSION, flags=0,
          header_len=None, crc=None) -> bytes:
    """Assemble a file from raw parts, with any frame field overridable."""
    hl = len(header) if header_len is None else header_len
    c = zlib.crc32(header) if crc is None else crc
    return A.FRAME.pack(magic, version, flags, hl, c) + header + payload


def header_for(payload: bytes, cert: A.CertInfo, **overrides) -> bytes:
    """A CBOR header matching `payload` (length + hash), with top-level fields overridable."""
    h = cert.to_header(len(payload))
    h["payload"]["sha256"] = hashlib.sha256(payload).digest()
    h.update(overrides)
    return cbor2.dumps(h)


def file_with_payload(payload: bytes, cert: A.CertInfo, **header_overrides) -> bytes:
    return frame(header_for(payload, cert, **header_overrides), payload)


def rising_keys(rng, n_kv, g, hd, n_ctx):
    """(q, k, v) whose scores rise along the context (by ~0.05 a token, so a softmax reference
    that moves by a margin moves dozens of times) with one spike far above the rest at n_ctx // 3."""
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    direction = q.reshape(n_kv, g, hd).mean(axis=1)
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    rise = np.arange(n_ctx, dtype=np.float32)[None, :, None] * 0.4 / np.sqrt(hd) * direction[:, None, :]
    k = (rng.standard_normal((n_kv, n_ctx, hd)) * 0.3 + rise).astype(np.float32)
    k[:, n_ctx // 3] += 30.0 * direction  # a spike: the reference jumps, then falls behind the rise
    return q, k, rng.standard_normal((n_kv, n_ctx, hd), dtype=np.float32)
