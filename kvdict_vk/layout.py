"""Arena arithmetic: where every word of a KV arena lives (DESIGN.md, "Arena layout").

Pure Python/NumPy — no GPU import, no I/O — so the GPU backend (`kvdict_vk.vk`) and the
dump tool read the same numbers. One storage buffer per layer:

    layer = [K region][V region][K atoms][V atoms][K mean][V mean]

* coded region       word(h, t, j) = region + (h·n_ctx + t)·s + j          (s = the stream's sparsity)
* passthrough region word(h, t, e) = region + (h·n_ctx + t)·head_dim + e
* the K region, the V region and the tail start on a 64-word (256-byte) boundary; the
  tail blocks are packed: atoms n_atoms×head_dim f32 (the layer's block of
  ``atoms_flat()``, zeros for a passthrough stream), then the means (zeros when absent).
* no active dictionary → every stream passthrough and no tail: the default f32 cache.

Test-only guard mode (``guard_words > 0``) leaves at least that many sentinel words
before and after every region and tail block and at the end of each layer buffer; every
word outside a region/block is then a guard, so a test can prove no shader wrote (or
read, when the sentinel is a NaN) outside its region.

The push-constant blocks the shaders read are defined here, once (``PUSH_BLOCKS``); a
test parses every shader's GLSL ``layout(push_constant)`` block and compares.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import errors as E
from .dictionary import MAX_N_ATOMS, KvDictArtifact

WORD_BYTES = 4
ALIGN_WORDS = 64  # 256 bytes: ≥ any minStorageBufferOffsetAlignment, one cache line pair
VEC4_WORDS = 4
DEFAULT_GUARD_VALUE = 0x7FA5A5A5  # a NaN as float32; as a code word its coefficient is NaN


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# --- what the layout needs to know about a dictionary --------------------------------------

@dataclass(frozen=True)
class StreamSpec:
    """One stream as the layout sees it: coded (with its own sparsity) or passthrough."""
    coded: bool
    sparsity: int = 0
    has_mean: bool = False


@dataclass(frozen=True)
class DictSpec:
    """The per-stream coded/sparsity description of an artifact (all the layout needs)."""
    head_dim: int
    n_atoms: int
    sparsity: int  # the artifact's maximum
    layers: tuple  # per layer a (K, V) pair of StreamSpec

    @classmethod
    def from_artifact(cls, art: KvDictArtifact) -> "DictSpec":
        def spec(d):
            if d is None:
                return StreamSpec(False)
            return StreamSpec(True, d.sparsity, d.mean is not None)
        return cls(art.head_dim, art.n_atoms, art.sparsity,
                   tuple((spec(k), spec(v)) for k, v in art.layers))


# --- the layout objects ------------------------------------------------------------------

@dataclass(frozen=True)
class StreamLayout:
    layer: int
    stream: str  # "k" or "v"
    coded: bool
    sparsity: int  # 0 for passthrough
    has_mean: bool
    n_kv_heads: int
    head_dim: int
    n_ctx: int
    row_words: int  # words per (head, token): s (coded) or head_dim (passthrough)
    region_word: int
    region_words: int
    atoms_word: int | None  # None in the f32 layout (no tail)
    atoms_words: int
    mean_word: int | None
    mean_words: int

    def word(self, head: int, token: int, j: int = 0) -> int:
        """Word index (within the layer buffer) of code word j / element j of (head, token)."""
        if not (0 <= head < self.n_kv_heads and 0 <= token < self.n_ctx and 0 <= j < self.row_words):
            raise E.ArenaError(f"word({head}, {token}, {j}) outside ({self.n_kv_heads}, "
                               f"{self.n_ctx}, {self.row_words})")
        return self.region_word + (head * self.n_ctx + token) * self.row_words + j

    @property
    def bytes_per_token(self) -> int:
        return self.n_kv_heads * self.row_words * WORD_BYTES

    def to_dict(self) -> dict:
        return {"layer": self.layer, "stream": self.stream, "coded": self.coded,
                "sparsity": self.sparsity, "has_mean": self.has_mean,
                "row_words": self.row_words,
                "region": _span(self.region_word, self.region_words),
                "atoms": None if self.atoms_word is None else _span(self.atoms_word, self.atoms_words),
                "mean": None if self.mean_word is None else _span(self.mean_word, self.mean_words),
                "bytes_per_token": self.bytes_per_token}


def _span(word: int, words: int) -> dict:
    return {"word": word, "words": words, "byte": word * WORD_BYTES, "bytes": words * WORD_BYTES}


@dataclass(frozen=True)
class LayerLayout:
    index: int
    k: StreamLayout
    v: StreamLayout
    tail_word: int | None
    tail_words: int
    total_words: int
    guard_spans: tuple = ()  # ((start, stop), …) word ranges holding the sentinel

    @property
    def streams(self) -> tuple[StreamLayout, StreamLayout]:
        return (self.k, self.v)

    @property
    def total_bytes(self) -> int:
        return self.total_words * WORD_BYTES

    def to_dict(self) -> dict:
        return {"layer": self.index, "total": _span(0, self.total_words),
                "tail": None if self.tail_word is None else _span(self.tail_word, self.tail_words),
                "k": self.k.to_dict(), "v": self.v.to_dict(),
                "guard_spans": [list(s) for s in self.guard_spans]}


@dataclass(frozen=True)
class ArenaLayout:
    mode: str  # "dict" or "f32"
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_ctx: int
    n_atoms: int  # 0 in the f32 layout
    sparsity: int  # the artifact's maximum; 0 in the f32 layout
    guard_words: int
    guard_value: int
    layers: tuple = field(repr=False)

    @property
    def total_words(self) -> int:
        return sum(l.total_words for l in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.total_words * WORD_BYTES

    @property
    def max_layer_bytes(self) -> int:
        return max(l.total_bytes for l in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token adds to the cache (all layers, K and V, all KV heads)."""
        return sum(s.bytes_per_token for l in self.layers for s in l.streams)

    @property
    def f32_bytes_per_token(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * WORD_BYTES

    @property
    def tail_bytes(self) -> int:
        return sum(l.tail_words for l in self.layers) * WORD_BYTES

    def to_dict(self) -> dict:
        return {"mode": self.mode, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "n_ctx": self.n_ctx, "n_atoms": self.n_atoms,
                "sparsity": self.sparsity, "guard_words": self.guard_words,
                "guard_value": self.guard_value, "word_bytes": WORD_BYTES,
                "align_words": ALIGN_WORDS, "total_bytes": self.total_bytes,
                "max_layer_bytes": self.max_layer_bytes, "tail_bytes": self.tail_bytes,
                "bytes_per_token": self.bytes_per_token,
                "f32_bytes_per_token": self.f32_bytes_per_token,
                "layers": [l.to_dict() for l in self.layers]}


# --- building ------------------------------------------------------------------------------

def _positive(**dims) -> None:
    for name, v in dims.items():
        if type(v) is not int and not isinstance(v, np.integer) or v < 1:
            raise E.ArenaError(f"{name} must be a positive integer, got {v!r}")


def build_layout(n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int,
                 dictionary: KvDictArtifact | DictSpec | None = None, *,
                 guard_words: int = 0, guard_value: int = DEFAULT_GUARD_VALUE) -> ArenaLayout:
    """The arena layout for a model's dims and (optionally) the active dictionary."""
    _positive(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, n_ctx=n_ctx)
    n_layers, n_kv_heads, head_dim, n_ctx = map(int, (n_layers, n_kv_heads, head_dim, n_ctx))
    if guard_words < 0:
        raise E.ArenaError(f"guard_words must be ≥ 0, got {guard_words}")
    guard = _round_up(int(guard_words), VEC4_WORDS)  # keeps vec4 alignment of what follows
    if not 0 <= guard_value < 1 << 32:
        raise E.ArenaError(f"guard_value {guard_value:#x} is not a 32-bit word")
    spec = DictSpec.from_artifact(dictionary) if isinstance(dictionary, KvDictArtifact) else dictionary
    if spec is not None:
        if len(spec.layers) != n_layers:
            raise E.DictMismatchError(f"dictionary has {len(spec.layers)} layers, model {n_layers}")
        if spec.head_dim != head_dim:
            raise E.DictMismatchError(f"dictionary head_dim {spec.head_dim}, model {head_dim}")
        if not 1 <= spec.n_atoms <= MAX_N_ATOMS:
            raise E.DictMismatchError(f"n_atoms {spec.n_atoms} outside 1..{MAX_N_ATOMS}")
    layers = tuple(_layer(i, n_kv_heads, head_dim, n_ctx, spec, guard) for i in range(n_layers))
    return ArenaLayout("f32" if spec is None else "dict", n_layers, n_kv_heads, head_dim, n_ctx,
                       0 if spec is None else spec.n_atoms, 0 if spec is None else spec.sparsity,
                       guard, int(guard_value), layers)


def _layer(index, n_kv, hd, n_ctx, spec: DictSpec | None, guard: int) -> LayerLayout:
    cursor = 0
    placed = []  # (start, stop) of every region/block, for the guard spans

    def place(words: int, align: int) -> int:
        nonlocal cursor
        start = _round_up(cursor + guard, align)
        cursor = start + words
        placed.append((start, cursor))
        return start

    pair = (StreamSpec(False), StreamSpec(False)) if spec is None else spec.layers[index]
    for ss, name in zip(pair, "KV"):
        if ss.coded and not 1 <= ss.sparsity <= min(hd, spec.n_atoms):
            raise E.DictMismatchError(f"layer {index} {name}: sparsity {ss.sparsity} outside "
                                      f"1..min(head_dim, n_atoms)")
        if ss.coded and ss.sparsity > spec.sparsity:
            raise E.DictMismatchError(f"layer {index} {name}: sparsity {ss.sparsity} exceeds "
                                      f"the artifact's {spec.sparsity}")
    rows = [ss.sparsity if ss.coded else hd for ss in pair]
    regions = [place(n_kv * n_ctx * r, ALIGN_WORDS) for r in rows]
    tail_word, tail_words, atoms, means = None, 0, [None, None], [None, None]
    if spec is not None:
        atom_words = spec.n_atoms * hd
        # Packed tail; in guard mode every block gets its own guards (vec4-aligned).
        block_align = VEC4_WORDS if guard else 1
        atoms = [place(atom_words, ALIGN_WORDS), place(atom_words, block_align)]
        means = [place(hd, block_align), place(hd, block_align)]
        tail_word, tail_words = atoms[0], cursor - atoms[0]
    total = _round_up(cursor + guard, ALIGN_WORDS)
    spans = []
    if guard:
        prev = 0
        for start, stop in placed:
            spans.append((prev, start))
            prev = stop
        spans.append((prev, total))
    streams = [StreamLayout(index, name, ss.coded, ss.sparsity if ss.coded else 0, ss.has_mean,
                            n_kv, hd, n_ctx, r, reg, n_kv * n_ctx * r,
                            a, 0 if a is None else spec.n_atoms * hd, m, 0 if m is None else hd)
               for ss, name, r, reg, a, m in zip(pair, "kv", rows, regions, atoms, means)]
    return LayerLayout(index, streams[0], streams[1], tail_word, tail_words, total,
                       tuple(s for s in spans if s[1] > s[0]))


def layer_tail_image(layout: ArenaLayout, layer: int, atoms_flat: np.ndarray | None,
                     means: tuple) -> np.ndarray:
    """The words of one layer's tail (uint32), ready to upload at ``tail_word``: K atoms,
    V atoms, K mean, V mean (zeros for passthrough / absent), guards in between if any.

    ``atoms_flat`` is the runtime's ``atoms_flat()`` array; ``means`` the layer's
    (K mean, V mean), each (head_dim,) or None."""
    ll = layout.layers[layer]
    if ll.tail_word is None:
        raise E.ArenaError("the f32 layout has no tail")
    img = np.full(ll.tail_words, layout.guard_value, np.uint32)
    block = layout.n_atoms * layout.head_dim
    flat = np.asarray(atoms_flat, np.float32).reshape(layout.n_layers, 2, block)
    for j, st in enumerate(ll.streams):
        a0 = st.atoms_word - ll.tail_word
        img[a0:a0 + block] = flat[layer, j].view(np.uint32)
        m0 = st.mean_word - ll.tail_word
        mean = np.zeros(layout.head_dim, np.float32) if means[j] is None else np.asarray(means[j], np.float32)
        img[m0:m0 + layout.head_dim] = mean.view(np.uint32)
    return img


# --- push-constant blocks (the ONE definition; GLSL mirrors it, a test checks) ----------------

@dataclass(frozen=True)
class PushBlock:
    """A GLSL ``layout(push_constant) uniform <name> { … }`` block of 32-bit scalars.
    Packed as uint32 words — floats bit-cast — because Kompute takes the push-constant
    dtype from the specialization constants, which are uint32 (DESIGN.md, Known traps)."""
    name: str
    fields: tuple  # ((field name, "uint" | "float"), …) in declaration order

    @property
    def size_bytes(self) -> int:
        return len(self.fields) * WORD_BYTES

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.fields)

    def pack(self, **values) -> np.ndarray:
        missing = [n for n in self.field_names if n not in values]
        extra = sorted(set(values) - set(self.field_names))
        if missing or extra:
            raise E.DispatchError(f"{self.name}: missing {missing}, unknown {extra}")
        out = np.empty(len(self.fields), np.uint32)
        for i, (n, t) in enumerate(self.fields):
            v = values[n]
            if t == "float":
                out[i] = np.array([v], np.float32).view(np.uint32)[0]
            else:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise E.DispatchError(f"{self.name}.{n}: {v!r} is not an integer")
                if not 0 <= int(v) < 1 << 32:
                    raise E.DispatchError(f"{self.name}.{n} = {v} does not fit a uint32")
                out[i] = int(v)
        return out

    def unpack(self, words) -> dict:
        w = np.asarray(words, np.uint32)
        if w.shape != (len(self.fields),):
            raise E.DispatchError(f"{self.name}: {w.shape} words, expected {len(self.fields)}")
        return {n: (float(w[i:i + 1].view(np.float32)[0]) if t == "float" else int(w[i]))
                for i, (n, t) in enumerate(self.fields)}


def _block(name: str, *names: str) -> PushBlock:
    return PushBlock(name, tuple((n, "uint") for n in names))


# Offsets are in words (4 bytes) in every block, even for the vec4 variants: the shader
# divides, Python checks the alignment.
RECONSTRUCT_PUSH = _block("ReconstructPush", "src_word", "atoms_word", "mean_word", "n_atoms",
                          "n_ctx", "t0", "n_tok", "n_rows", "out_word")
COPY_ROWS_PUSH = _block("CopyRowsPush", "src_word", "n_ctx", "t0", "n_tok", "n_rows", "out_word")
SCATTER_PUSH = _block("ScatterPush", "src_word", "dst_word", "row_words", "group_rows",
                      "group_stride", "n_words")
COPY_PUSH = _block("CopyPush", "src_word", "dst_word", "n_words")

PUSH_BLOCKS = {b.name: b for b in (RECONSTRUCT_PUSH, COPY_ROWS_PUSH, SCATTER_PUSH, COPY_PUSH)}
# shader source file → the block it declares
SHADER_PUSH_BLOCKS = {"reconstruct.comp": RECONSTRUCT_PUSH, "copy_rows.comp": COPY_ROWS_PUSH,
                      "scatter.comp": SCATTER_PUSH, "copy.comp": COPY_PUSH}
