"""In-memory KV dictionaries: validated, immutable, float32.

`StreamDict` is one stream's dictionary (K or V of one layer); `KvDictArtifact` is the
whole payload of a `.q42art` (see :mod:`kvdict_vk.artifact` for its bytes). Both validate
on construction and freeze their arrays (``writeable=False``), so a snapshot installed in
the runtime can be shared by every reader without copies or locks.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from . import errors as E
from .residual import MAX_BITS as MAX_RESIDUAL_BITS, slot_words
from .rope import KeyRope
from .window import NO_WINDOW, ExactWindow

MAX_N_ATOMS = 1 << 16  # a code word's atom index is 16 bits
# code words a slot the forge learns by default (forge.pipeline.ForgeConfig, both streams): the
# certified format's, and the benchmarks' default (bench.common)
FORGE_SPARSITY = 4
# residual bits (K, V) the forge certifies by default (forge.pipeline.ForgeConfig): the
# benchmarks mark this format's rows ``default``
FORGE_RESIDUAL_BITS = (6, 4)
# atoms a dictionary, and whether each KV head has its own (False: one a stream, shared by
# the layer's KV heads) — the forge's defaults (docs/FIDELITY.md, "Dictionaries shared by the
# KV heads"), the memory report's and the benchmarks'
FORGE_N_ATOMS = 1024
FORGE_PER_HEAD = False


def _frozen_f32(a, shape: tuple[int, ...], what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiu":
        raise E.TypedArrayError(f"{what}: dtype {arr.dtype} is not numeric")
    if arr.shape != shape:
        raise E.DimsError(f"{what}: shape {arr.shape}, expected {shape}")
    if arr.dtype == np.float32 and not arr.flags.writeable and arr.flags.c_contiguous \
            and arr.dtype.byteorder in "=|<":
        out = arr  # already frozen (e.g. straight from the CBOR decoder): no copy
    else:
        out = np.array(arr, dtype=np.float32, order="C", copy=True)
    if not np.isfinite(out).all():
        raise E.NonFiniteError(f"{what}: holds NaN or Inf")
    out.flags.writeable = False
    return out


def _f16_rounded(a: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(``a`` as float32, its binary16 rounding back in float32 — None where some value is
    beyond binary16's range)."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return a, (h.astype(np.float32) if np.isfinite(h).all() else None)


def is_f16_exact(a: np.ndarray) -> bool:
    """Whether float32 ``a`` holds only binary16 values (finite in f16, no bits lost)."""
    a, rounded = _f16_rounded(a)
    return rounded is not None and np.array_equal(rounded, a)


def round_to_f16(a: np.ndarray) -> np.ndarray:
    """``a`` (float32) rounded to binary16 values, kept as float32 — unless some value is
    beyond binary16's range, then ``a`` unchanged (such atoms stay float32 only)."""
    a, rounded = _f16_rounded(a)
    return a if rounded is None else rounded


@dataclass(frozen=True, eq=False)
class HeadDict:
    """One KV head's view of a stream's dictionary (2-D atoms, 1-D mean/scale)."""
    atoms: np.ndarray  # (n_atoms, head_dim)
    mean: np.ndarray | None  # (head_dim,)
    metric: np.ndarray | None  # (head_dim, head_dim)
    sparsity: int
    residual_bits: int
    residual_scale: np.ndarray | None  # (head_dim,)


@dataclass(frozen=True, eq=False)
class StreamDict:
    """One stream's dictionary (K or V of one layer), shared by the layer's KV heads
    (n_heads == 1) or one per KV head (n_heads == n_kv_heads).

    A head vector x of head h is coded as x ≈ mean[h] + Σ_j c_j · atoms[h, idx_j] + r̂,
    the atoms chosen by OMP minimising ‖metric · (x − x̂)‖ (Euclidean when metric is None),
    and — when residual_bits > 0 — r̂ the residual quantised to that many bits per element
    with the static per-channel scale residual_scale[h] (see kvdict_vk.residual).
    """
    atoms: np.ndarray  # (n_heads, n_atoms, head_dim) float32 (2-D input = one shared head)
    mean: np.ndarray | None = None  # (n_heads, head_dim) (1-D input is tiled over heads)
    metric: np.ndarray | None = None  # (head_dim, head_dim), shared by the heads
    sparsity: int = 1  # atoms per head vector for this stream
    residual_bits: int = 0  # 0 = no residual stage
    residual_scale: np.ndarray | None = None  # (n_heads, head_dim), > 0; iff residual_bits
    where: str = "dictionary"  # for error messages only

    def __post_init__(self):
        a = np.asarray(self.atoms)
        if a.ndim == 2:
            a = a[None]
        if a.ndim != 3 or min(a.shape) < 1:
            raise E.DimsError(f"{self.where}.atoms: shape {a.shape}, expected ([n_heads,] n_atoms, head_dim)")
        g, n, d = a.shape
        if n > MAX_N_ATOMS:
            raise E.DimsError(f"{self.where}.atoms: {n} atoms exceed {MAX_N_ATOMS}")
        atoms = _frozen_f32(a, (g, n, d), f"{self.where}.atoms")
        zero = np.argwhere(~np.any(atoms != 0, axis=2))
        if zero.size:
            raise E.ZeroAtomError(f"{self.where}.atoms: atom {int(zero[0, 1])} of head "
                                  f"{int(zero[0, 0])} is all zeros")
        object.__setattr__(self, "atoms", atoms)
        object.__setattr__(self, "mean", self._per_head(self.mean, g, d, "mean"))
        if self.metric is not None:
            object.__setattr__(self, "metric", _frozen_f32(self.metric, (d, d), f"{self.where}.metric"))
        s = self.sparsity
        if type(s) is not int and not isinstance(s, np.integer):
            raise E.SchemaError(f"{self.where}.sparsity is not an integer")
        if not 1 <= s <= min(d, n):
            raise E.DimsError(f"{self.where}.sparsity {s} outside 1..min(head_dim={d}, n_atoms={n})")
        object.__setattr__(self, "sparsity", int(s))
        b = self.residual_bits
        if type(b) is not int and not isinstance(b, np.integer):
            raise E.SchemaError(f"{self.where}.residual_bits is not an integer")
        if not 0 <= b <= MAX_RESIDUAL_BITS:
            raise E.DimsError(f"{self.where}.residual_bits {b} outside 0..{MAX_RESIDUAL_BITS}")
        object.__setattr__(self, "residual_bits", int(b))
        if (b > 0) != (self.residual_scale is not None):
            raise E.SchemaError(f"{self.where}: residual_scale is required exactly when residual_bits > 0")
        scale = self._per_head(self.residual_scale, g, d, "residual_scale")
        if scale is not None and not (scale > 0).all():
            raise E.DimsError(f"{self.where}.residual_scale must be > 0")
        object.__setattr__(self, "residual_scale", scale)

    def _per_head(self, v, g: int, d: int, name: str):
        if v is None:
            return None
        v = np.asarray(v)
        if v.ndim == 1 and g > 1:
            v = np.broadcast_to(v, (g, d))
        elif v.ndim == 1:
            v = v[None]
        return _frozen_f32(v, (g, d), f"{self.where}.{name}")

    @property
    def n_heads(self) -> int:
        return self.atoms.shape[0]

    @property
    def n_atoms(self) -> int:
        return self.atoms.shape[1]

    @property
    def head_dim(self) -> int:
        return self.atoms.shape[2]

    @property
    def slot_words(self) -> int:
        """uint32 words per coded head vector: code words, then the residual stage."""
        return slot_words(self.head_dim, self.sparsity, self.residual_bits)

    def head(self, h: int) -> HeadDict:
        """The dictionary KV head h uses (head 0's for every h when shared)."""
        g = 0 if self.n_heads == 1 else h
        if not 0 <= g < self.n_heads:
            raise E.LayerIndexError(f"{self.where}: KV head {h} outside 0..{self.n_heads - 1}")
        return HeadDict(self.atoms[g], None if self.mean is None else self.mean[g], self.metric,
                        self.sparsity, self.residual_bits,
                        None if self.residual_scale is None else self.residual_scale[g])


@dataclass(frozen=True, eq=False)
class KvDictArtifact:
    """The serialized dictionary payload: per layer a (K, V) pair of StreamDict or None
    (passthrough). All dictionaries share head_dim, n_atoms and n_heads (1 = shared by a
    layer's KV heads, else one per KV head), so every layer's atom tail in the arena has
    the same shape; each stream has its own sparsity (≤ the artifact's `sparsity`, the
    maximum) and residual bits. ``window``: the tokens the cache keeps in binary16 beside
    their slots (kvdict_vk.window), part of what was certified. ``key_rope``: the key streams
    code keys before RoPE turns them (kvdict_vk.rope), None: after."""
    head_dim: int
    n_atoms: int
    sparsity: int
    layers: tuple
    window: ExactWindow = NO_WINDOW
    key_rope: KeyRope | None = None

    def __post_init__(self):
        if not isinstance(self.window, ExactWindow):
            raise E.SchemaError(f"window is a {type(self.window).__name__}, not an ExactWindow")
        if self.key_rope is not None:
            if not isinstance(self.key_rope, KeyRope):
                raise E.SchemaError(f"key_rope is a {type(self.key_rope).__name__}, not a KeyRope")
            self.key_rope.check_head_dim(self.head_dim)
        layers = tuple(tuple(pair) for pair in self.layers)
        object.__setattr__(self, "layers", layers)
        if not layers:
            raise E.DimsError("an artifact needs at least one layer")
        if not 1 <= self.n_atoms <= MAX_N_ATOMS:
            raise E.DimsError(f"n_atoms {self.n_atoms} outside 1..{MAX_N_ATOMS}")
        if not 1 <= self.sparsity <= min(self.head_dim, self.n_atoms):
            raise E.DimsError(f"sparsity {self.sparsity} outside 1..min(head_dim, n_atoms)")
        heads = set()
        for i, pair in enumerate(layers):
            if len(pair) != 2:
                raise E.DimsError(f"layers[{i}] must be a (K, V) pair")
            for name, d in zip("kv", pair):
                if d is None:
                    continue
                if not isinstance(d, StreamDict):
                    raise E.SchemaError(f"layers[{i}].{name} is not a StreamDict")
                if d.atoms.shape[1:] != (self.n_atoms, self.head_dim):
                    raise E.DimsError(f"layers[{i}].{name}.atoms: shape {d.atoms.shape}, "
                                      f"expected (n_heads, {self.n_atoms}, {self.head_dim})")
                if d.sparsity > self.sparsity:
                    raise E.DimsError(f"layers[{i}].{name}.sparsity {d.sparsity} exceeds "
                                      f"the artifact's sparsity {self.sparsity}")
                heads.add(d.n_heads)
        if len(heads) > 1:
            raise E.DimsError(f"dictionaries disagree on n_heads: {sorted(heads)}")
        object.__setattr__(self, "_n_heads", heads.pop() if heads else 1)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        """Dictionary heads per stream: 1 (shared by the KV heads) or n_kv_heads."""
        return self._n_heads

    def stream(self, layer: int, k_not_v: bool) -> StreamDict | None:
        return self.layers[layer][0 if k_not_v else 1]

    def stream_rope(self, layer: int, k_not_v: bool) -> KeyRope | None:
        """The RoPE a coded stream's vectors were coded before (key streams of a key_rope
        artifact), else None: what an encode turns back and a decode turns on."""
        return self.key_rope if k_not_v and self.layers[layer][0] is not None else None

    @functools.cached_property  # the artifact is immutable: computed once, on first use
    def atoms_f16_exact(self) -> bool:
        """Whether every coded stream's atoms are binary16 values (finite, each equal to its
        f16 rounding): the forge rounds its atoms so (forge.learn), and then the arena keeps
        them in binary16 — the same values in half the bytes (docs/ARENA.md)."""
        return all(is_f16_exact(d.atoms) for pair in self.layers for d in pair if d is not None)

    def with_f16_atoms(self) -> "KvDictArtifact":
        """This artifact with every coded stream's atoms rounded to binary16 values
        (``round_to_f16``), everything else as it is: what the forge makes
        (``ForgeConfig.f16_atoms``), for validating and testing the arena's binary16 atoms."""
        return KvDictArtifact(self.head_dim, self.n_atoms, self.sparsity, tuple(
            tuple(None if d is None else dataclasses.replace(d, atoms=round_to_f16(d.atoms)) for d in pair)
            for pair in self.layers), self.window, self.key_rope)

    def atoms_flat(self) -> np.ndarray:
        """[layer][K atoms n_heads×n_atoms×head_dim][V atoms …] float32, zeros for
        passthrough: the arena's per-layer atom tail, concatenated."""
        flat = np.zeros((self.n_layers, 2, self.n_heads, self.n_atoms, self.head_dim), np.float32)
        for i, pair in enumerate(self.layers):
            for j, d in enumerate(pair):
                if d is not None:
                    flat[i, j] = d.atoms
        return flat.reshape(-1)

    def nbytes(self) -> int:
        """Bytes of the dictionaries themselves (atoms, means, metrics, scales), float32."""
        return sum(sum(a.nbytes for a in (d.atoms, d.mean, d.metric, d.residual_scale) if a is not None)
                   for pair in self.layers for d in pair if d is not None)
