"""Process-wide install + toggle of the certified KV dictionaries (the seed's contract).

Engine side only: pure Python/NumPy, no GPU import, never imports the forge.

The whole state is one immutable :class:`Snapshot` behind one module global. Writers
build a new snapshot (verifying files outside the lock) and swap the reference under a
lock; readers take ``_STATE`` once and work on that object, so a reader never sees a
torn state — e.g. "enabled" from one install and the atoms of another. Arrays in a
snapshot are read-only, so sharing them needs no copy ("clone" is free).

The user switch has three parts, as in the seed: the environment variable
``KVDICT_VK_ARTIFACT=/path/to/file.q42art`` activates a certified artifact when this
module is first imported; :func:`activate` / :func:`deactivate` set it at run time;
:func:`dict_active` reads it back. Like the int8 toggle it takes effect at the next
arena creation (the layout is chosen then, see ``kvdict_vk.vk.KvArena``).

Two doors lead in. The certified one — :func:`load_certified`, :func:`activate` and the
environment variable — takes only a framed file whose certificate passed its gate, and
verifies all of it. The other — :func:`install`, :func:`install_from_cbor`,
:func:`enable` with an artifact and :func:`enabled_with` — takes dictionaries that carry
no certificate (the forge certifying its candidate, kvdict-validate's and the benchmarks'
random dictionaries, tests) and opens only when the caller says
``allow_uncertified=True``; without it they raise :class:`~kvdict_vk.errors.UncertifiedError`
and change nothing.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, replace

import numpy as np

from . import codec
from . import errors as E
from .artifact import CertInfo, payload_from_cbor, read_artifact
from .dictionary import KvDictArtifact, StreamDict

ENV_ARTIFACT = "KVDICT_VK_ARTIFACT"
log = logging.getLogger("kvdict_vk")


@dataclass(frozen=True)
class Snapshot:
    enabled: bool = False
    artifact: KvDictArtifact | None = None
    cert: CertInfo | None = None  # None when installed from a bare payload
    generation: int = 0  # bumped by every swap; lets holders notice a change

    @property
    def active(self) -> bool:
        return self.enabled and self.artifact is not None


_STATE = Snapshot()
_LOCK = threading.Lock()
startup_error: E.KvDictError | None = None  # what the environment variable's activation raised


def snapshot() -> Snapshot:
    """The current state, as one consistent object."""
    return _STATE


def _swap(**changes) -> Snapshot:
    global _STATE
    with _LOCK:
        _STATE = replace(_STATE, generation=_STATE.generation + 1, **changes)
        return _STATE


# --- install / toggle -------------------------------------------------------------------

def load_certified(path: str | os.PathLike) -> CertInfo:
    """Verify a framed artifact (frame, header, kind == KvDictionary, passed == true,
    payload length + SHA-256, schema, dims) and install it. Fail-closed: on any error a
    typed :class:`~kvdict_vk.errors.ArtifactError` is raised and the installed state is
    exactly as before. The toggle is not changed."""
    cert, art = read_artifact(path, require_certified=True)
    _swap(artifact=art, cert=cert)
    return cert


def _consent(what: str, allow_uncertified: bool) -> None:
    """The uncertified door opens only when the caller says so."""
    if not allow_uncertified:
        raise E.UncertifiedError(
            f"{what}() installs dictionaries without a certificate; pass allow_uncertified=True to mean "
            f"it, or load a certified file with load_certified()/activate()")


def _uncertified(what: str, artifact, allow_uncertified: bool) -> KvDictArtifact:
    if not isinstance(artifact, KvDictArtifact):
        raise E.SchemaError(f"{what}() needs a KvDictArtifact, got {type(artifact).__name__}")
    _consent(what, allow_uncertified)
    return artifact


def install(artifact: KvDictArtifact, *, allow_uncertified: bool = False) -> None:
    """Install dictionaries that carry no certificate (toggle unchanged); refused with
    UncertifiedError unless ``allow_uncertified=True``."""
    _swap(artifact=_uncertified("install", artifact, allow_uncertified), cert=None)


def install_from_cbor(payload: bytes, *, allow_uncertified: bool = False) -> None:
    """Decode a bare CBOR KvDictArtifact payload (the bytes after the provenance header)
    and install it. A bare payload has no certificate: refused with UncertifiedError
    unless ``allow_uncertified=True`` (checked before decoding)."""
    _consent("install_from_cbor", allow_uncertified)
    install(payload_from_cbor(bytes(payload)), allow_uncertified=True)


def enable(artifact: KvDictArtifact | None = None, *, allow_uncertified: bool = False) -> None:
    """Turn reconstruction ON, over what is installed; given an artifact (which carries no
    certificate), install it first — refused with UncertifiedError unless
    ``allow_uncertified=True``."""
    if artifact is None:
        _swap(enabled=True)
    else:
        _swap(enabled=True, artifact=_uncertified("enable", artifact, allow_uncertified), cert=None)


def disable() -> None:
    """Turn reconstruction OFF; the dictionaries stay installed."""
    _swap(enabled=False)


def restore(state: Snapshot) -> None:
    """Put back the installed dictionaries, certificate and toggle of an earlier
    :func:`snapshot` (a new generation: holders notice). For code that switches for a
    while inside a larger program; it can only bring back what was installed before."""
    if not isinstance(state, Snapshot):
        raise E.SchemaError(f"restore() needs a Snapshot, got {type(state).__name__}")
    _swap(enabled=state.enabled, artifact=state.artifact, cert=state.cert)


@contextlib.contextmanager
def enabled_with(artifact: KvDictArtifact, *, allow_uncertified: bool = False):
    """``enable(artifact, allow_uncertified=…)`` for the block, then :func:`restore` of the
    state before. For code that creates an arena in a given mode inside a larger program:
    tools, benchmarks, tests."""
    prev = snapshot()
    enable(artifact, allow_uncertified=allow_uncertified)
    try:
        yield
    finally:
        restore(prev)


@contextlib.contextmanager
def activated(path: str | os.PathLike):
    """``activate(path)`` for the block (yielding its CertInfo), then :func:`restore` of the
    state before: a certified artifact for the arenas a block makes (kvdict-generate)."""
    prev = snapshot()
    try:
        yield activate(path)
    finally:
        restore(prev)


def is_enabled() -> bool:
    return _STATE.enabled


def activate(path: str | os.PathLike) -> CertInfo:
    """User switch ON: load a certified artifact and turn the dict-coded cache on, in one
    atomic step. Fail-closed via load_certified. Takes effect at the next arena creation."""
    cert, art = read_artifact(path, require_certified=True)
    _swap(enabled=True, artifact=art, cert=cert)
    return cert


def deactivate() -> None:
    """User switch OFF: toggle off and drop the dictionaries; the next arena is f32."""
    _swap(enabled=False, artifact=None, cert=None)


def clear() -> None:
    """Free the installed dictionaries (toggle unchanged)."""
    _swap(artifact=None, cert=None)


def dict_active() -> bool:
    """Toggle on AND a dictionary installed."""
    return _STATE.active


# --- read-back --------------------------------------------------------------------------

def installed_meta() -> tuple[int, int] | None:
    """(sparsity, head_dim) of the installed artifact, or None."""
    art = _STATE.artifact
    return None if art is None else (art.sparsity, art.head_dim)


def sparsity() -> int:
    """The installed sparsity k (the artifact's maximum), 0 if nothing is installed."""
    art = _STATE.artifact
    return 0 if art is None else art.sparsity


def installed_cert() -> CertInfo | None:
    return _STATE.cert


def clone_layer_dict(layer: int, k_not_v: bool) -> StreamDict | None:
    """A layer's K (k_not_v=True) or V dictionary, or None if passthrough / nothing
    installed. The returned object is immutable and shared: no copy is made."""
    art = _STATE.artifact
    if art is None:
        return None
    if not 0 <= layer < art.n_layers:
        raise E.LayerIndexError(f"layer {layer} outside 0..{art.n_layers - 1}")
    return art.stream(layer, k_not_v)


def atoms_flat() -> tuple[np.ndarray, int, int] | None:
    """(flat, n_atoms, head_dim): installed atoms in the arena layout
    [layer][K atoms n_atoms×head_dim][V atoms …], zeros for passthrough; None if empty."""
    art = _STATE.artifact
    return None if art is None else (art.atoms_flat(), art.n_atoms, art.head_dim)


# --- write path -----------------------------------------------------------------------------

def reconstruct_kv(layer: int, k_not_v: bool, proj: np.ndarray, n_kv: int, *, n_tokens: int = 1,
                   t0: int | None = None) -> bool:
    """Replace the first n_tokens·n_kv head vectors of ``proj`` (float32, laid out
    [token][kv head][head_dim], ≥ n_tokens·n_kv·head_dim values) with what the dict-coded
    cache returns for them, in place: encode, code words (+ residual stage), decode —
    exactly what a read of the GPU arena gives. Returns whether it did.

    No-op (one check) when disabled; no-op when the layer has no dictionary or does not
    fit: the caller's head_dim differs (``proj`` 2-D+ with another last dimension, or too
    short) or the dictionary is per-head for another number of KV heads. Keys of an artifact
    that codes them before RoPE (kvdict_vk.rope) need ``t0``, the position of the first token:
    they are turned back from their positions, coded, and turned again (ShapeError without it)."""
    st = _STATE
    if not st.active:
        return False
    art = st.artifact
    if not 0 <= layer < art.n_layers:
        return False
    d = art.stream(layer, k_not_v)
    if d is None:
        return False
    if not isinstance(proj, np.ndarray) or proj.dtype != np.float32:
        raise E.ShapeError("reconstruct_kv: proj must be a float32 numpy array")
    if not proj.flags.writeable:
        raise E.ShapeError("reconstruct_kv: proj is read-only")
    hd = art.head_dim
    if proj.ndim > 1 and proj.shape[-1] != hd:
        return False
    if n_kv < 0 or n_tokens < 0 or proj.size < n_tokens * n_kv * hd:
        return False
    if d.n_heads > 1 and n_kv != d.n_heads:
        return False
    flat = proj.reshape(-1)  # a view for contiguous arrays (checked below)
    if not np.shares_memory(flat, proj):
        raise E.ShapeError("reconstruct_kv: proj must be contiguous")
    heads = flat[: n_tokens * n_kv * hd].reshape(n_tokens, n_kv, hd)
    rope = art.stream_rope(layer, k_not_v)
    if rope is not None and (isinstance(t0, bool) or not isinstance(t0, (int, np.integer)) or t0 < 0):
        raise E.ShapeError(f"reconstruct_kv: layer {layer}'s keys are coded before RoPE: give t0, the "
                           f"position of the first token (got {t0!r})")
    heads[...] = codec.held_heads(heads.transpose(1, 0, 2), d, rope, t0 or 0, np.float32).transpose(1, 0, 2)
    return True


def _activate_from_environment() -> None:
    global startup_error
    path = os.environ.get(ENV_ARTIFACT)
    if not path:
        return
    try:
        cert = activate(path)
        log.info("kvdict_vk: activated %s (%s = %+.4g)", path, cert.metric, cert.value)
    except E.KvDictError as e:  # fail-closed: stay on the default cache, say why
        startup_error = e
        log.error("kvdict_vk: %s=%s refused, dict cache stays off: %s", ENV_ARTIFACT, path, e)


_activate_from_environment()
