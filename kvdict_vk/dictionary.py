"""In-memory KV dictionaries: validated, immutable, float32.

`StreamDict` is one stream's dictionary (K or V of one layer); `KvDictArtifact` is the
whole payload of a `.q42art` (see :mod:`kvdict_vk.artifact` for its bytes). Both validate
on construction and freeze their arrays (``writeable=False``), so a snapshot installed in
the runtime can be shared by every reader without copies or locks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import errors as E

MAX_N_ATOMS = 1 << 16  # a code word's atom index is 16 bits


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


@dataclass(frozen=True, eq=False)
class StreamDict:
    """One stream's dictionary: x ≈ mean + Σ_j c_j · atoms[idx_j], the code chosen by OMP
    minimising ‖metric · (x − x̂)‖ (Euclidean when metric is None)."""
    atoms: np.ndarray  # (n_atoms, head_dim) float32, finite, no zero row
    mean: np.ndarray | None = None  # (head_dim,)
    metric: np.ndarray | None = None  # (head_dim, head_dim)
    sparsity: int = 1  # atoms per head vector for this stream
    where: str = "dictionary"  # for error messages only

    def __post_init__(self):
        a = np.asarray(self.atoms)
        if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
            raise E.DimsError(f"{self.where}.atoms: shape {a.shape}, expected (n_atoms, head_dim)")
        n, d = a.shape
        if n > MAX_N_ATOMS:
            raise E.DimsError(f"{self.where}.atoms: {n} atoms exceed {MAX_N_ATOMS}")
        atoms = _frozen_f32(a, (n, d), f"{self.where}.atoms")
        zero = np.flatnonzero(~np.any(atoms != 0, axis=1))
        if zero.size:
            raise E.ZeroAtomError(f"{self.where}.atoms: atom {int(zero[0])} is all zeros")
        object.__setattr__(self, "atoms", atoms)
        if self.mean is not None:
            object.__setattr__(self, "mean", _frozen_f32(self.mean, (d,), f"{self.where}.mean"))
        if self.metric is not None:
            object.__setattr__(self, "metric", _frozen_f32(self.metric, (d, d), f"{self.where}.metric"))
        s = self.sparsity
        if type(s) is not int and not isinstance(s, np.integer):
            raise E.SchemaError(f"{self.where}.sparsity is not an integer")
        if not 1 <= s <= min(d, n):
            raise E.DimsError(f"{self.where}.sparsity {s} outside 1..min(head_dim={d}, n_atoms={n})")
        object.__setattr__(self, "sparsity", int(s))

    @property
    def n_atoms(self) -> int:
        return self.atoms.shape[0]

    @property
    def head_dim(self) -> int:
        return self.atoms.shape[1]


@dataclass(frozen=True, eq=False)
class KvDictArtifact:
    """The serialized dictionary payload: per layer a (K, V) pair of StreamDict or None
    (passthrough). All dictionaries share head_dim and n_atoms (the arena's atom tail is
    uniform); each may use a sparsity ≤ the artifact's `sparsity` (the maximum)."""
    head_dim: int
    n_atoms: int
    sparsity: int
    layers: tuple

    def __post_init__(self):
        layers = tuple(tuple(pair) for pair in self.layers)
        object.__setattr__(self, "layers", layers)
        if not layers:
            raise E.DimsError("an artifact needs at least one layer")
        if not 1 <= self.n_atoms <= MAX_N_ATOMS:
            raise E.DimsError(f"n_atoms {self.n_atoms} outside 1..{MAX_N_ATOMS}")
        if not 1 <= self.sparsity <= min(self.head_dim, self.n_atoms):
            raise E.DimsError(f"sparsity {self.sparsity} outside 1..min(head_dim, n_atoms)")
        for i, pair in enumerate(layers):
            if len(pair) != 2:
                raise E.DimsError(f"layers[{i}] must be a (K, V) pair")
            for name, d in zip("kv", pair):
                if d is None:
                    continue
                if not isinstance(d, StreamDict):
                    raise E.SchemaError(f"layers[{i}].{name} is not a StreamDict")
                if d.atoms.shape != (self.n_atoms, self.head_dim):
                    raise E.DimsError(f"layers[{i}].{name}.atoms: shape {d.atoms.shape}, "
                                      f"expected ({self.n_atoms}, {self.head_dim})")
                if d.sparsity > self.sparsity:
                    raise E.DimsError(f"layers[{i}].{name}.sparsity {d.sparsity} exceeds "
                                      f"the artifact's sparsity {self.sparsity}")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def stream(self, layer: int, k_not_v: bool) -> StreamDict | None:
        return self.layers[layer][0 if k_not_v else 1]

    def atoms_flat(self) -> np.ndarray:
        """[layer][K atoms n_atoms×head_dim][V atoms …] float32, zeros for passthrough."""
        flat = np.zeros((self.n_layers, 2, self.n_atoms, self.head_dim), np.float32)
        for i, pair in enumerate(self.layers):
            for j, d in enumerate(pair):
                if d is not None:
                    flat[i, j] = d.atoms
        return flat.reshape(-1)

    def nbytes(self) -> int:
        """Bytes of the dictionaries themselves (atoms, means, metrics) as float32."""
        return sum(d.atoms.nbytes + (0 if d.mean is None else d.mean.nbytes)
                   + (0 if d.metric is None else d.metric.nbytes)
                   for pair in self.layers for d in pair if d is not None)
