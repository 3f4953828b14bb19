"""Arena arithmetic: where every word of a KV arena lives (docs/ARENA.md explains it word by word).

Pure Python/NumPy — no GPU import, no I/O — so the GPU backend (`kvdict_vk.vk`) and the
dump tool read the same numbers. One storage buffer per layer:

    layer = [K region][V region][K atoms][V atoms][K mean][V mean][K scale][V scale]

* coded region       word(h, t, j) = region + (h·n_ctx + t)·slot_words + j
  a slot (docs/FORMAT.md) is the stream's ``sparsity`` code words, then — residual_bits
  b > 0 — ⌈head_dim·b/32⌉ words of b-bit levels and one float32 step word
* passthrough region word(h, t, e) = region + (h·n_ctx + t)·head_dim + e (f32 rows), or
  region + (h·n_ctx + t)·head_dim/2 + e/2 (f16 rows: element 2k in the low half of a word,
  2k+1 in the high half — unpackHalf2x16 reads it, no 16-bit storage feature needed)
* the K region, the V region and the tail start on a 64-word (256-byte) boundary; the
  tail blocks are packed, each for the G dictionary heads (G = 1: shared by the KV heads,
  G = n_kv_heads: one per KV head): the atoms (zeros for a passthrough stream), then the
  means G×head_dim and the residual scales G×head_dim (zeros when absent). The atoms are
  stored ONCE: in binary16 when the artifact's atoms are all binary16 values
  (``KvDictArtifact.atoms_f16_exact``: the forge rounds them so) and head_dim % 8 == 0 —
  G×n_atoms×head_dim/2 words a stream, each atom's elements in chunk-pair order
  (``atoms_f16_order``: quad p of an atom — 4 words, 8 halves — holds elements 4p … 4p+3,
  then head_dim/2 + 4p … head_dim/2 + 4p+3; two halves a word, the lower element in the low
  half; every reader widens them exactly, shaders/atoms.glsl), each block on a 4-word
  boundary — else in float32, G×n_atoms×head_dim words (exactly the layer's block of
  ``atoms_flat()``).
* an artifact with an exact window (kvdict_vk.window): after the regions, each coded
  stream's window block — n_kv × window.rows binary16 rows, token t at window.row_of(t) —
  and the layer's state word (the tokens appended), before the tail
* an artifact whose keys are coded before RoPE (kvdict_vk.rope): a layer with a coded K
  stream ends its tail with the K stream's rotation table (rope.table_rows(n_ctx) × head_dim
  float32 words, its lo angles quad-major: kvdict_vk.rope; on a 4-word boundary), which reads
  and attention turn its keys with
* no active dictionary → every stream passthrough and no tail: the uncoded cache, f16 by
  default (``cache="f32"`` keeps f32 rows). Passthrough streams of a dict-coded layout
  (streams the artifact leaves uncoded) keep f32 rows.

Test-only guard mode (``guard_words > 0``) leaves at least that many sentinel words
before and after every region and tail block and at the end of each layer buffer; every
word outside a region/block is then a guard, so a test can prove no shader wrote (or
read, when the sentinel is a NaN) outside its region.

The row formats' words (q8_0, f16 pairs, binary16 atoms) and a layer's tail image are
:mod:`kvdict_vk.rows`; the push-constant blocks the shaders read, :mod:`kvdict_vk.vk.abi`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import errors as E
from . import kivi as K
from .dictionary import MAX_N_ATOMS, KvDictArtifact
from .residual import MAX_BITS as MAX_RESIDUAL_BITS, residual_words, slot_words
from .rope import KeyRope, table_block, table_hi_rows, table_rows
from .window import NO_WINDOW, ExactWindow

WORD_BYTES = 4
ALIGN_WORDS = 64  # 256 bytes: ≥ any minStorageBufferOffsetAlignment, one cache line pair
VEC4_WORDS = 4
DEFAULT_GUARD_VALUE = 0x7FA5A5A5  # a NaN as float32; as a code word its coefficient is NaN
CACHES = ("f16", "f32", "q8_0")  # row formats of the uncoded cache
KIVI_CACHE = "kivi"  # the KIVI-style quantised cache (kvdict_vk.kivi): a mode of its own
Q8_BLOCK = 32  # q8_0 (llama.cpp): 32 int8 values and one f16 scale per block
DEFAULT_CACHE = "f16"  # what engines keep (llama.cpp's default); f32 is the exact option
ATOMS_F16_ELEMS = 8  # elements of an atom in one quad (4 words) of binary16 atoms (rows.atoms_f16_order)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def q8_scale_words(head_dim: int) -> int:
    """Words of a q8_0 row's f16 block scales (two to a word)."""
    return -(-(head_dim // Q8_BLOCK) // 2)


def row_words(head_dim: int, sparsity: int, residual_bits: int, rows: str = "f32") -> int:
    """Words per (KV head, token) of a region: the slot of a coded stream (sparsity ≥ 1);
    for a passthrough one (sparsity 0) in ``rows`` format: head_dim float32 ("f32"),
    head_dim/2 words of f16 pairs ("f16"), or q8_0's block scales then head_dim int8 four
    to a word ("q8_0": 17 words = 68 bytes at head_dim 64, llama.cpp's size)."""
    if sparsity:
        return slot_words(head_dim, sparsity, residual_bits)
    if rows == "q8_0":
        return q8_scale_words(head_dim) + head_dim // 4
    return head_dim // 2 if rows == "f16" else head_dim


# --- what the layout needs to know about a dictionary --------------------------------------

@dataclass(frozen=True)
class StreamSpec:
    """One stream as the layout sees it: coded (its sparsity, residual bits, dictionary
    heads) or passthrough. ``slot_words`` 0 means "derive it" (sparsity + the residual
    words for the layout's head_dim); a non-zero value must agree with that."""
    coded: bool
    sparsity: int = 0
    has_mean: bool = False
    residual_bits: int = 0
    n_heads: int = 1  # dictionary heads: 1 (shared by the KV heads) or n_kv_heads
    slot_words: int = 0


@dataclass(frozen=True)
class DictSpec:
    """The per-stream description of an artifact (all the layout needs)."""
    head_dim: int
    n_atoms: int
    sparsity: int  # the artifact's maximum
    layers: tuple  # per layer a (K, V) pair of StreamSpec
    n_heads: int = 1  # dictionary heads of every stream (KvDictArtifact.n_heads)
    atoms_f16: bool = False  # every atom a binary16 value (KvDictArtifact.atoms_f16_exact)
    window: ExactWindow = NO_WINDOW  # the coded streams' exact window (KvDictArtifact.window)
    key_rope: KeyRope | None = None  # keys coded before RoPE (KvDictArtifact.key_rope)

    @classmethod
    def from_artifact(cls, art: KvDictArtifact) -> "DictSpec":
        def spec(d):
            if d is None:
                return StreamSpec(False)
            return StreamSpec(True, d.sparsity, d.mean is not None, d.residual_bits, d.n_heads, d.slot_words)
        return cls(art.head_dim, art.n_atoms, art.sparsity,
                   tuple((spec(k), spec(v)) for k, v in art.layers), art.n_heads, art.atoms_f16_exact,
                   art.window, art.key_rope)


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
    row_words: int  # words per (head, token): the slot (coded), head_dim (f32) or head_dim/2 (f16)
    region_word: int
    region_words: int
    atoms_word: int | None  # None in the f32 layout (no tail)
    atoms_words: int  # all dictionary heads: n_dict_heads × n_atoms × head_dim (÷ 2: atoms_f16)
    mean_word: int | None
    mean_words: int  # n_dict_heads × head_dim
    residual_bits: int = 0
    n_dict_heads: int = 1  # 1: one dictionary shared by the KV heads; n_kv_heads: one each
    scale_word: int | None = None  # residual scales, n_dict_heads × head_dim
    scale_words: int = 0
    rows: str = "f32"  # passthrough rows: "f32", "f16" (two per word), "q8_0" or "kivi"
    # The KIVI cache (rows "kivi", kvdict_vk.kivi): the levels' bits; the keys' group
    # statistics (⌈seq_ctx / GROUP⌉ × head_dim words per KV head and sequence, K only); the
    # exact window, a ring of window_tokens binary16 rows per KV head and sequence (token t at
    # t mod window_tokens); and a state word per sequence (how many of its tokens are
    # quantised, written by every append). A batched arena's kivi_seqs sequences each hold
    # seq_ctx = n_ctx / kivi_seqs rows of a KV head's region (rows s · seq_ctx ..); their
    # statistics and rings go by the "KIVI head" g · kivi_seqs + s (kivi_head).
    # A dict-coded stream with an exact window (kvdict_vk.window) uses window_word,
    # window_tokens (the window's rows) and state_word (the tokens appended) the same way.
    kivi_bits: int = 0
    kivi_seqs: int = 1
    stats_word: int | None = None
    stats_words: int = 0
    window_word: int | None = None
    window_tokens: int = 0
    state_word: int | None = None
    # The atoms block holds binary16 atoms in chunk-pair order (atoms_f16_order), not float32
    # rows: atoms that are all binary16 values, head_dim % 8 == 0.
    atoms_f16: bool = False
    exact_window: ExactWindow = NO_WINDOW  # a coded stream's exact window
    # A K stream coded before RoPE (kvdict_vk.rope): its rotation table in the tail.
    key_rope: KeyRope | None = None
    rope_word: int | None = None
    rope_words: int = 0

    @property
    def rope_block(self) -> int:
        """B of the rotation table (rope.table_block): position t = hi·B + lo."""
        return table_block(self.n_ctx)

    @property
    def rope_shift(self) -> int:
        """log2 B: the shaders split a position as (t >> shift, t & (B − 1))."""
        return self.rope_block.bit_length() - 1

    @property
    def rope_hi_rows(self) -> int:
        """The table's hi rows (rope.table_hi_rows); its lo rows follow them."""
        return table_hi_rows(self.n_ctx)

    @property
    def windowed(self) -> bool:
        """A dict-coded stream that keeps an exact window beside its slots."""
        return self.coded and bool(self.exact_window)

    @property
    def row_format(self) -> str:
        """"slot" (dict-coded), or the passthrough rows' format: "f16", "f32", "q8_0" or "kivi"."""
        return "slot" if self.coded else self.rows

    @property
    def kivi(self) -> bool:
        return not self.coded and self.rows == KIVI_CACHE

    @property
    def window_words(self) -> int:
        """Words of a KIVI or windowed stream's exact windows (binary16 pairs; else 0)."""
        return K.window_words(self.n_kv_heads, self.kivi_seqs, self.window_tokens, self.head_dim)

    @property
    def seq_ctx(self) -> int:
        """Rows of a KV head a sequence holds (a batched KIVI stream's n_ctx / kivi_seqs)."""
        return self.n_ctx // self.kivi_seqs

    def kivi_head(self, head: int, seq: int = 0) -> int:
        """The KIVI head of (KV head, sequence): its key statistics (⌈seq_ctx / GROUP⌉ groups
        of head_dim words) and its ring (window_tokens rows) are the kivi_head-th (kivi.glsl's
        kivi_head)."""
        return head * self.kivi_seqs + seq

    def kivi_stats_word(self, head: int, seq: int, t: int) -> int:
        """The first of the head_dim stats words of token t's key group in (KV head, sequence)
        (kivi.glsl's kivi_stats_row)."""
        groups = -(-self.seq_ctx // K.GROUP)  # a KIVI head's
        return self.stats_word + (self.kivi_head(head, seq) * groups + t // K.GROUP) * self.head_dim

    def kivi_ring_word(self, head: int, seq: int, t: int) -> int:
        """The first word of token t's binary16 row in (KV head, sequence)'s ring (kivi.glsl's
        kivi_window_row)."""
        return self.window_word + (self.kivi_head(head, seq) * self.window_tokens + t % self.window_tokens) * (
            self.head_dim // 2)

    @property
    def half(self) -> bool:
        return not self.coded and self.rows == "f16"

    @property
    def q8(self) -> bool:
        return not self.coded and self.rows == "q8_0"

    def word(self, head: int, token: int, j: int = 0) -> int:
        """Word index (within the layer buffer) of slot word j / element j of (head, token)."""
        if not (0 <= head < self.n_kv_heads and 0 <= token < self.n_ctx and 0 <= j < self.row_words):
            raise E.ArenaError(f"word({head}, {token}, {j}) outside ({self.n_kv_heads}, "
                               f"{self.n_ctx}, {self.row_words})")
        return self.region_word + (head * self.n_ctx + token) * self.row_words + j

    @property
    def slot_words(self) -> int:
        """Words of a coded head vector (0 for passthrough)."""
        return self.row_words if self.coded else 0

    @property
    def level_words(self) -> int:
        """Words of the residual levels bitstream in a slot (0 without a residual stage)."""
        return residual_words(self.head_dim, self.residual_bits) - 1 if self.residual_bits else 0

    @property
    def head_atoms_stride(self) -> int:
        """Words from one KV head's atoms to the next's: 0 when the dictionary is shared."""
        return self.atoms_words // self.n_dict_heads if self.n_dict_heads > 1 else 0

    @property
    def head_vec_stride(self) -> int:
        """Words from one KV head's mean (or residual scale) to the next's: 0 when shared."""
        return self.head_dim if self.n_dict_heads > 1 else 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token adds (a KIVI key's share of its group's statistics included)."""
        stats = self.stats_words / self.n_ctx if self.kivi else 0
        return round(self.n_kv_heads * self.row_words * WORD_BYTES + stats * WORD_BYTES)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "stream": self.stream, "coded": self.coded,
                "sparsity": self.sparsity, "has_mean": self.has_mean,
                "residual_bits": self.residual_bits, "n_dict_heads": self.n_dict_heads,
                "row_format": self.row_format, "row_words": self.row_words, "slot_words": self.slot_words,
                "region": _span(self.region_word, self.region_words),
                "atoms": None if self.atoms_word is None else _span(self.atoms_word, self.atoms_words),
                "atoms_format": None if self.atoms_word is None else ("f16" if self.atoms_f16 else "f32"),
                "mean": None if self.mean_word is None else _span(self.mean_word, self.mean_words),
                "residual_scale": None if self.scale_word is None else _span(self.scale_word, self.scale_words),
                "bytes_per_token": self.bytes_per_token,
                **({"kivi_bits": self.kivi_bits, "window_tokens": self.window_tokens,
                    "group_stats": None if self.stats_word is None else _span(self.stats_word, self.stats_words),
                    "window": _span(self.window_word, self.window_words),
                    "state": _span(self.state_word, self.kivi_seqs), "seqs": self.kivi_seqs} if self.kivi else {}),
                **({"key_rope": self.key_rope.to_dict(), "rope_block": self.rope_block,
                    "rope_table": _span(self.rope_word, self.rope_words)} if self.key_rope else {}),
                **({"exact_window": {"sink": self.exact_window.sink, "recent": self.exact_window.recent},
                    "window": _span(self.window_word, self.window_words),
                    "state": _span(self.state_word, 1)} if self.windowed else {})}


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
    def windowed(self) -> bool:
        """A dict-coded layer whose coded streams keep an exact window (kvdict_vk.window)."""
        return self.k.windowed or self.v.windowed

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
    mode: str  # "dict", "kivi", or the uncoded cache's row format: "f16", "f32" or "q8_0"
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_ctx: int
    n_atoms: int  # 0 in the f32 layout
    sparsity: int  # the artifact's maximum; 0 in the f32 layout
    guard_words: int
    guard_value: int
    layers: tuple = field(repr=False)
    n_dict_heads: int = 1  # dictionary heads per stream (1 = shared); 1 in the f32 layout
    kivi: K.KiviSpec | None = None  # the KIVI cache's settings (mode "kivi")

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
    def f16_bytes_per_token(self) -> int:
        return self.f32_bytes_per_token // 2

    @property
    def tail_bytes(self) -> int:
        return sum(l.tail_words for l in self.layers) * WORD_BYTES

    def guard_breaches(self, layer_words) -> list[tuple[int, int, int, list[int]]]:
        """Guard mode: every guard span whose words no longer all hold the sentinel, as
        (layer, start, stop, the first 8 overwritten word indices); ``layer_words(i)``
        gives layer i's words (e.g. ``KvArena.layer_words``). Empty when all are intact."""
        out = []
        for ll in self.layers:
            if not ll.guard_spans:
                continue
            words = layer_words(ll.index)
            for lo, hi in ll.guard_spans:
                bad = np.flatnonzero(words[lo:hi] != self.guard_value)
                if bad.size:
                    out.append((ll.index, lo, hi, (lo + bad[:8]).tolist()))
        return out

    def to_dict(self) -> dict:
        return {"mode": self.mode, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "n_ctx": self.n_ctx, "n_atoms": self.n_atoms,
                "sparsity": self.sparsity, "n_dict_heads": self.n_dict_heads,
                **({"kivi": dict(k_bits=self.kivi.k_bits, v_bits=self.kivi.v_bits, recent=self.kivi.recent,
                                 group=K.GROUP)} if self.kivi else {}),
                "guard_words": self.guard_words,
                "guard_value": self.guard_value, "word_bytes": WORD_BYTES,
                "align_words": ALIGN_WORDS, "total_bytes": self.total_bytes,
                "max_layer_bytes": self.max_layer_bytes, "tail_bytes": self.tail_bytes,
                "bytes_per_token": self.bytes_per_token,
                "f32_bytes_per_token": self.f32_bytes_per_token,
                "f16_bytes_per_token": self.f16_bytes_per_token,
                "layers": [l.to_dict() for l in self.layers]}


# --- building ------------------------------------------------------------------------------

def check_positive(**dims) -> None:
    """ArenaError unless every value is a positive integer (Python or NumPy; not a bool)."""
    for name, v in dims.items():
        if type(v) is not int and not isinstance(v, np.integer) or v < 1:
            raise E.ArenaError(f"{name} must be a positive integer, got {v!r}")


def build_layout(n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int,
                 dictionary: KvDictArtifact | DictSpec | None = None, *,
                 guard_words: int = 0, guard_value: int = DEFAULT_GUARD_VALUE,
                 cache: str = DEFAULT_CACHE, kivi=None, seqs: int = 1) -> ArenaLayout:
    """The arena layout for a model's dims and (optionally) the active dictionary; without
    one, ``cache`` is the row format of the uncoded cache ("f16", "f32", "q8_0"), or "kivi"
    (the KIVI-style cache, settings ``kivi``: a kvdict_vk.kivi.KiviSpec, default KiviSpec()).
    ``seqs``: the sequences n_ctx holds (n_ctx / seqs rows a KV head each) — a KIVI cache
    keeps statistics, rings and a state word for each."""
    check_positive(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, n_ctx=n_ctx, seqs=seqs)
    n_layers, n_kv_heads, head_dim, n_ctx, seqs = map(int, (n_layers, n_kv_heads, head_dim, n_ctx, seqs))
    if n_ctx % seqs:
        raise E.ArenaError(f"n_ctx {n_ctx} does not hold {seqs} sequences of equal length")
    if guard_words < 0:
        raise E.ArenaError(f"guard_words must be ≥ 0, got {guard_words}")
    guard = _round_up(int(guard_words), VEC4_WORDS)  # keeps vec4 alignment of what follows
    if not 0 <= guard_value < 1 << 32:
        raise E.ArenaError(f"guard_value {guard_value:#x} is not a 32-bit word")
    spec = DictSpec.from_artifact(dictionary) if isinstance(dictionary, KvDictArtifact) else dictionary
    if cache not in CACHES + (KIVI_CACHE,):
        raise E.ArenaError(f"cache must be one of {CACHES + (KIVI_CACHE,)}, got {cache!r}")
    if cache == KIVI_CACHE:
        if spec is not None:
            raise E.ArenaError("a KIVI cache has no dictionary: build it without one")
        kivi = K.KiviSpec() if kivi is None else kivi
        if not isinstance(kivi, K.KiviSpec):
            raise E.ArenaError(f"kivi must be a kvdict_vk.kivi.KiviSpec, got {type(kivi).__name__}")
        try:
            K.check_head_dim(head_dim)
        except E.DimsError as e:
            raise E.ArenaError(str(e)) from None
    else:
        kivi = None
    rows = cache if spec is None else "f32"  # an artifact's passthrough streams keep f32 rows
    if rows == "f16" and head_dim % 2:
        raise E.ArenaError(f"an f16 cache needs an even head_dim, got {head_dim}")
    if rows == "q8_0" and head_dim % Q8_BLOCK:
        raise E.ArenaError(f"a q8_0 cache needs head_dim a multiple of {Q8_BLOCK}, got {head_dim}")
    if spec is not None:
        if len(spec.layers) != n_layers:
            raise E.DictMismatchError(f"dictionary has {len(spec.layers)} layers, model {n_layers}")
        if spec.head_dim != head_dim:
            raise E.DictMismatchError(f"dictionary head_dim {spec.head_dim}, model {head_dim}")
        if not 1 <= spec.n_atoms <= MAX_N_ATOMS:
            raise E.DictMismatchError(f"n_atoms {spec.n_atoms} outside 1..{MAX_N_ATOMS}")
        if spec.n_heads not in (1, n_kv_heads):
            raise E.DictMismatchError(f"the dictionary has {spec.n_heads} heads per stream; the model "
                                      f"has {n_kv_heads} KV heads (per-head dictionaries need one each)")
    layers = tuple(_layer(i, n_kv_heads, head_dim, n_ctx, spec, guard, rows, kivi, seqs) for i in range(n_layers))
    return ArenaLayout(cache if spec is None else "dict", n_layers, n_kv_heads, head_dim, n_ctx,
                       0 if spec is None else spec.n_atoms, 0 if spec is None else spec.sparsity,
                       guard, int(guard_value), layers, 1 if spec is None else spec.n_heads, kivi)


def _slot_words(index: int, name: str, ss: StreamSpec, spec: DictSpec, hd: int) -> int:
    """Check a coded stream against the artifact and the model; its slot size in words."""
    where = f"layer {index} {name}"
    if not 1 <= ss.sparsity <= min(hd, spec.n_atoms):
        raise E.DictMismatchError(f"{where}: sparsity {ss.sparsity} outside 1..min(head_dim, n_atoms)")
    if ss.sparsity > spec.sparsity:
        raise E.DictMismatchError(f"{where}: sparsity {ss.sparsity} exceeds the artifact's {spec.sparsity}")
    if not 0 <= ss.residual_bits <= MAX_RESIDUAL_BITS:
        raise E.DictMismatchError(f"{where}: residual_bits {ss.residual_bits} outside 0..{MAX_RESIDUAL_BITS}")
    if ss.n_heads != spec.n_heads:
        raise E.DictMismatchError(f"{where}: {ss.n_heads} dictionary heads, the artifact's streams have "
                                  f"{spec.n_heads}")
    slot = slot_words(hd, ss.sparsity, ss.residual_bits)
    if ss.slot_words not in (0, slot):
        raise E.DictMismatchError(f"{where}: slot_words {ss.slot_words}, expected {slot}")
    return slot


def _layer(index, n_kv, hd, n_ctx, spec: DictSpec | None, guard: int, pass_rows: str = "f32",
           kivi=None, seqs: int = 1) -> LayerLayout:
    cursor = 0
    placed = []  # (start, stop) of every region/block, for the guard spans

    def place(words: int, align: int) -> int:
        nonlocal cursor
        start = _round_up(cursor + guard, align)
        cursor = start + words
        placed.append((start, cursor))
        return start

    pair = (StreamSpec(False), StreamSpec(False)) if spec is None else spec.layers[index]
    if kivi is not None:
        rows = [K.key_row_words(hd, kivi.k_bits), K.value_row_words(hd, kivi.v_bits)]
    else:
        rows = [_slot_words(index, name, ss, spec, hd) if ss.coded else row_words(hd, 0, 0, pass_rows)
                for ss, name in zip(pair, "KV")]
    regions = [place(n_kv * n_ctx * r, ALIGN_WORDS) for r in rows]
    kivi_fields = [{}, {}]
    if kivi is not None:
        n_stats = K.stats_words(n_kv, n_ctx, seqs, hd)
        stats = place(n_stats, ALIGN_WORDS)
        windows = [place(K.window_words(n_kv, seqs, kivi.window, hd), ALIGN_WORDS) for _ in "kv"]
        state = place(_round_up(seqs, VEC4_WORDS), VEC4_WORDS)
        kivi_fields = [dict(kivi_bits=kivi.bits(j == 0), kivi_seqs=seqs, stats_word=stats if j == 0 else None,
                            stats_words=n_stats if j == 0 else 0, window_word=windows[j],
                            window_tokens=kivi.window, state_word=state) for j in range(2)]
    elif spec is not None and spec.window and any(ss.coded for ss in pair):
        if hd % 2:
            raise E.DictMismatchError(f"an exact window keeps binary16 pairs: head_dim {hd} is odd")
        win = spec.window
        windows = [place(n_kv * K.window_words_per_head(win.rows, hd), ALIGN_WORDS) if ss.coded else None
                   for ss in pair]
        state = place(VEC4_WORDS, VEC4_WORDS)
        kivi_fields = [dict(window_word=w, window_tokens=win.rows, state_word=state, exact_window=win)
                       if ss.coded else {} for ss, w in zip(pair, windows)]
    tail_word, tail_words = None, 0
    atoms, means, scales = [None, None], [None, None], [None, None]
    g = 1 if spec is None else spec.n_heads
    atoms_f16 = spec is not None and spec.atoms_f16 and hd % ATOMS_F16_ELEMS == 0
    atom_words = 0
    if spec is not None:
        atom_words = g * spec.n_atoms * hd // (2 if atoms_f16 else 1)
        # Packed tail; in guard mode every block gets its own guards (vec4-aligned).
        block_align = VEC4_WORDS if guard else 1
        atoms = [place(atom_words, ALIGN_WORDS), place(atom_words, block_align)]
        means = [place(g * hd, block_align), place(g * hd, block_align)]
        scales = [place(g * hd, block_align), place(g * hd, block_align)]
        if spec.key_rope is not None and pair[0].coded:
            try:
                spec.key_rope.check_head_dim(hd)
            except E.DimsError as e:
                raise E.DictMismatchError(str(e)) from None
            rope_words = table_rows(n_ctx) * hd
            kivi_fields[0] = dict(kivi_fields[0], key_rope=spec.key_rope, rope_words=rope_words,
                                  rope_word=place(rope_words, VEC4_WORDS))
        tail_word, tail_words = atoms[0], cursor - atoms[0]
    total = _round_up(cursor + guard, ALIGN_WORDS)
    spans = []
    if guard:
        prev = 0
        for start, stop in placed:
            spans.append((prev, start))
            prev = stop
        spans.append((prev, total))
    streams = [StreamLayout(index, name, ss.coded, ss.sparsity if ss.coded else 0, ss.coded and ss.has_mean,
                            n_kv, hd, n_ctx, r, reg, n_kv * n_ctx * r,
                            a, 0 if a is None else atom_words, m, 0 if m is None else g * hd,
                            ss.residual_bits if ss.coded else 0, g, sc, 0 if sc is None else g * hd,
                            pass_rows, **kf, atoms_f16=atoms_f16)
               for ss, name, r, reg, a, m, sc, kf in zip(pair, "kv", rows, regions, atoms, means, scales,
                                                         kivi_fields)]
    return LayerLayout(index, streams[0], streams[1], tail_word, tail_words, total,
                       tuple(s for s in spans if s[1] > s[0]))
