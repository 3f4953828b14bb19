"""The KV arena on the GPU: one storage buffer per layer, laid out by kvdict_vk.layout.

The runtime snapshot is read ONCE, at creation: active → the dict-coded layout, with each
layer's atoms, means and residual scales uploaded into its tail (an artifact that does not
fit the model is refused with DictMismatchError); otherwise the default f32 cache. Both
modes have the same API. Appends encode on the CPU (codec.encode_heads: OMP per KV head,
then the residual stage) and send ONLY the new slots — or raw f32 rows — through a small
host-visible upload buffer to the scatter shader. Reads reconstruct on the GPU (or copy
passthrough rows) into a read-back buffer; only the output crosses back. Decode attention
over the cache (both modes, one call) lives in kvdict_vk.vk.attend.engine.

Not thread-safe: one arena belongs to one thread at a time.
"""
from __future__ import annotations

import os

import numpy as np

from ... import codec, runtime
from ... import errors as E
from ... import layout as L
from ..device import Device, get_device, kp
from ...kivi import KiviSpec
from .kivi_store import KiviStore
from ..kernels import Buffer, Kernel, Write, barrier, run
from ..attend.engine import Attention, check_query, check_scale
from ..encode import choice as encode_choice
from ..read.reader import ReadPlan

SMALL_SCATTER_TOKENS = 4  # appends up to this many tokens use the small scatter pipeline
UPLOAD_CAP_WORDS = 1 << 20  # host-visible upload buffer, at most (4 MiB); larger appends are chunked
OUT_MIN_WORDS = 1 << 14  # smallest read-back buffer class (64 KiB) …
OUT_CLASS_STEP = 8  # … then ×8 per class, so a read copies back at most ~8× what it returns
OUT_CAP_WORDS = 1 << 24  # … up to 64 MiB (and the device limits); larger reads are chunked
ENCODERS = ("cpu", "gpu", "auto")
ENCODER_ENV = "KVDICT_VK_ENCODER"  # default of KvArena(encoder=None): "cpu", "gpu" or "auto"
GPU_ENCODE_BATCH = 1024  # vectors per GPU-encoder submission (bounds its work buffers to ~1–2 MiB)
MAX_SEQS = 1024  # sequences a batched arena holds at most
# GPUs ("chunk" mapping): how reconstruct maps a stream of s code words per slot, as
# (largest s, (output chunks of a row per invocation, pipelined)) in order, the first entry
# with s <= its bound applying; chunks fall back to 1 where they do not divide the row, and
# the copy_rows read keeps one. Measured on the H200 (1 GiB of f32 out, per-head
# dictionaries, 4-bit residual; bandwidth over the copy shader's in the same repeats,
# docs/results/h200/probes/reconstruct_mapping_per_sparsity.json): s 1 four chunks 1.40
# (two: 1.17); s 2 and 4 two chunks with the next row's slot words loaded early
# (reconstruct.comp's PIPELINED) 1.30 / 1.15 (plain: 1.11 / 1.02); s 8 and 16 two chunks
# plain 0.76 / 0.42 (pipelined: 0.59 / 0.40). This table is for float32 atoms; the next for
# the binary16 copy (gathered a quad at a time), which moved s 8 to pipelined
# (docs/results/h200/probes/reconstruct_mapping_binary16_atoms.json: s 8 601.9 µs pipelined,
# 660.6 plain; s 1 four chunks 373 µs, s 2 / 4 two pipelined 412 / 433; s 16 plain 934 vs 980).
RECONSTRUCT_GPU_MAPPINGS = ((1, (4, False)), (4, (2, True)), (None, (2, False)))
RECONSTRUCT_GPU_MAPPINGS_F16 = ((1, (4, False)), (8, (2, True)), (None, (2, False)))


CACHE_ENV = "KVDICT_VK_CACHE"  # the uncoded cache's row format when the switch is off: f16 / f32


def resolve_cache(cache: str | None, dict_active: bool) -> str:
    """The cache an arena gets: "dict", "kivi", or an uncoded row format (KvArena's ``cache``)."""
    if cache is None:
        if dict_active:
            return "dict"
        cache = os.environ.get(CACHE_ENV, "").strip().lower() or L.DEFAULT_CACHE
    if cache == "dict":
        if not dict_active:
            raise E.ArenaError("cache='dict' needs an active dictionary (kvdict_vk.runtime.activate)")
        return cache
    if cache not in L.CACHES + (L.KIVI_CACHE,):
        raise E.ArenaError(f"cache must be None, 'dict' or one of {L.CACHES + (L.KIVI_CACHE,)} (or ${CACHE_ENV}), "
                           f"got {cache!r}")
    return cache


class KvArena:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, *,
                 device: "int | str | Device | None" = None, shader_mapping: str | None = None,
                 guard_words: int = 0, guard_value: int = L.DEFAULT_GUARD_VALUE, encoder: str | None = None,
                 cache: str | None = None, kivi: KiviSpec | None = None, seqs: int = 1):
        """``shader_mapping``: "row" (one invocation per row: CPU drivers), "chunk" (one per
        4-float output chunk: GPUs) or None (by device type). ``guard_words``/``guard_value``:
        test-only sentinel words around every region (see kvdict_vk.layout). ``encoder``:
        where appends run OMP — "cpu" (codec, the reference), "gpu" (kvdict_vk.vk.encode.encoder,
        slots written straight into the layer) or "auto" (the faster of the two, measured on
        a GPU per format and batch size; the codec on CPU drivers: kvdict_vk.vk.encode.choice);
        None reads $KVDICT_VK_ENCODER, default "auto".
        ``cache``: None — the runtime switch decides: the dict-coded cache when a dictionary
        is active, else the uncoded cache in $KVDICT_VK_CACHE's row format ("f16" default,
        or "f32"); "dict" requires an active dictionary; "f16" / "f32" give that uncoded
        cache whatever the switch says; "kivi" the KIVI-style quantised cache (kvdict_vk.kivi)
        with the settings ``kivi`` (a KiviSpec; default: 4-bit keys and values, the 128 most
        recent tokens exact), whatever the switch says.
        ``seqs``: sequences the arena holds, each of up to n_ctx tokens, sharing the layers'
        dictionaries (batched decode: append/read with ``seq=``, attend_batch; a KV head's
        slice holds sequence s at rows s·n_ctx .. (s+1)·n_ctx − 1, docs/ARENA.md)."""
        L.check_positive(seqs=seqs, n_ctx=n_ctx)  # before n_ctx · seqs rows per head are laid out
        if seqs > MAX_SEQS:
            raise E.ArenaError(f"seqs must be at most {MAX_SEQS}, got {seqs}")
        if seqs > 1 and cache == L.KIVI_CACHE:
            raise E.ArenaError("a KIVI cache holds one sequence (its quantisation state is per layer)")
        self._seqs, self._seq_ctx = int(seqs), int(n_ctx)
        if encoder is None:
            encoder = os.environ.get(ENCODER_ENV, "").strip().lower() or "auto"
        if encoder not in ENCODERS:
            raise E.ArenaError(f"encoder must be one of {ENCODERS} (or ${ENCODER_ENV}), got {encoder!r}")
        self.encoder = encoder
        snap = runtime.snapshot()  # once: the layout never changes under a live arena
        cache = resolve_cache(cache, snap.active)
        art = snap.artifact if cache == "dict" else None
        if kivi is not None and cache != L.KIVI_CACHE:
            raise E.ArenaError(f"kivi settings given for a {cache!r} cache")
        self._layout = L.build_layout(n_layers, n_kv_heads, head_dim, n_ctx * self._seqs, art,
                                      guard_words=guard_words, guard_value=guard_value,
                                      cache=L.DEFAULT_CACHE if cache == "dict" else cache, kivi=kivi)
        self._kivi = KiviStore(self._layout) if cache == L.KIVI_CACHE else None
        self._art = art
        self._flat = None if art is None else art.atoms_flat()  # = runtime.atoms_flat() of the snapshot
        self.device = get_device(device)
        self._lanes = 4 if head_dim % 4 == 0 else 1
        # CPU drivers: one invocation per row (code words read once per row); GPUs: one per
        # output chunk (coalesced stores, code words broadcast by the cache).
        if shader_mapping is None:
            shader_mapping = "row" if self.device.is_cpu else "chunk"
        if shader_mapping not in ("row", "chunk"):
            raise E.ArenaError(f"shader_mapping must be 'row', 'chunk' or None, got {shader_mapping!r}")
        self.shader_mapping = shader_mapping
        self._chunks_per_row = head_dim // self._lanes  # vec4 (or scalar) chunks of a row, as the read shaders see it
        self._chunks = self._chunks_per_row if shader_mapping == "row" else 1
        self._caps = self._check_limits()  # ArenaTooLargeError before anything is allocated
        self._layers: list[Buffer] = []
        self._kernels: dict = {}
        self._outs: dict[int, Buffer] = {}
        self._upload = None
        self._attention: dict[int, Attention] = {}  # by query-head count, made on first attend
        self._encoders: dict = {}  # (layer, "k"/"v") → GpuEncoder, made on first GPU-encoded append
        self._step_barriers: dict = {}  # layer → the barrier after a step's scatter (made once)
        self._n_tokens = [[0] * self._seqs for _ in range(n_layers)]  # [layer][sequence]
        self._freed = False
        try:
            self._upload = Buffer(self.device, self._caps["upload"], "host", "upload buffer")
            for ll in self.layout.layers:
                self._layers.append(Buffer(self.device, ll.total_words, "storage", f"layer {ll.index} buffer"))
                self._init_layer(ll)
            self._flat = None  # uploaded; the arena keeps no host copy
        except BaseException:
            self.free()
            raise

    # --- sizing ---------------------------------------------------------------------------------
    def _check_limits(self) -> dict:
        lay, lim = self.layout, self.device.info.limits
        max_buf = min(lim["max_storage_buffer_range"], lim["max_memory_allocation_size"] or 1 << 62)
        name = self.device.name
        if lay.max_layer_bytes > max_buf:
            raise E.ArenaTooLargeError(f"{name}: a layer buffer needs {lay.max_layer_bytes} bytes, the "
                                       f"device binds at most {max_buf} (maxStorageBufferRange)")
        hd, n_kv = lay.head_dim, lay.n_kv_heads
        token_out = 2 * n_kv * hd
        token_up = max(n_kv * sum(s.row_words for s in ll.streams) for ll in lay.layers)
        out_cap = min(OUT_CAP_WORDS, max_buf // 4, max(OUT_MIN_WORDS, token_out * lay.n_ctx))
        out_cap -= out_cap % token_out
        # big enough for a full context or the tail/guard image of a layer, within the cap
        init = max((ll.total_words if ll.guard_spans else ll.tail_words) for ll in lay.layers)
        upload = min(UPLOAD_CAP_WORDS, max_buf // 4, max(token_up * lay.n_ctx, init))
        upload = max(upload - upload % token_up, token_up)
        if out_cap < token_out or upload * 4 > max_buf:
            raise E.ArenaTooLargeError(f"{name}: one token does not fit a {max_buf}-byte buffer")
        # read-back buffers are "device" tensors: device memory plus a staging copy
        total = lay.total_bytes + 4 * upload + 2 * 4 * out_cap * OUT_CLASS_STEP // (OUT_CLASS_STEP - 1)
        heap = self.device.info.device_local_bytes
        if total > heap:
            raise E.ArenaTooLargeError(f"{name}: the arena needs {total} bytes, the device heap has {heap}")
        return {"upload": upload, "out": out_cap, "token_out": token_out, "token_up": token_up}

    def _out_class(self, words: int) -> int:
        size = OUT_MIN_WORDS
        while size < words:
            size *= OUT_CLASS_STEP
        return min(size, self._caps["out"])

    # --- setup ------------------------------------------------------------------------------------
    def _init_layer(self, ll: L.LayerLayout) -> None:
        """Upload the tail (atoms, means); in guard mode, the whole layer: sentinels
        everywhere except the tail blocks."""
        if ll.k.kivi:  # the quantised end starts at 0 (storage buffers start undefined)
            image = np.full(ll.total_words, self.layout.guard_value, np.uint32) if ll.guard_spans else None
            if image is None:
                self._write_words(ll.index, ll.k.state_word, np.zeros(1, np.uint32))
            else:
                image[ll.k.state_word] = 0
                self._write_words(ll.index, 0, image)
            return
        if ll.tail_word is None and not ll.guard_spans:
            return
        lay = self.layout
        if ll.tail_word is not None:
            pair = self._art.layers[ll.index]
            means = tuple(None if d is None else d.mean for d in pair)
            scales = tuple(None if d is None else d.residual_scale for d in pair)
            tail = L.layer_tail_image(lay, ll.index, self._flat, means, scales)
        if ll.guard_spans:
            image = np.full(ll.total_words, lay.guard_value, np.uint32)
            if ll.tail_word is not None:
                image[ll.tail_word:ll.tail_word + ll.tail_words] = tail
            self._write_words(ll.index, 0, image)
        else:
            self._write_words(ll.index, ll.tail_word, tail)

    def _write_words(self, layer: int, dst_word: int, words: np.ndarray) -> None:
        """Contiguous words (a tail or guard image, a state word) at dst_word of the layer."""
        self._write_blocks(layer, [Write(dst_word, words.reshape(1, -1, 1), 0)], what=f"uploading layer {layer}")

    def _scatter(self, layer: int, n_words: int | None = None) -> Kernel:
        """The scatter pipeline for an upload of n_words (None: any size). Two sizes: a
        dispatch is sized when its pipeline is made, and llvmpipe spends a few µs on every
        workgroup even when its grid-stride loop has nothing to do — a one-token append
        through the upload-sized pipeline (4096 workgroups) took 10–20 ms."""
        small = n_words is not None and n_words <= self._caps["token_up"] * SMALL_SCATTER_TOKENS
        key = ("scatter", layer, small)
        if key not in self._kernels:
            items = self._caps["token_up"] * SMALL_SCATTER_TOKENS if small else self._caps["upload"]
            self._kernels[key] = Kernel(self.device, "scatter", [self._upload, self._layers[layer]], max_items=items)
        return self._kernels[key]

    def _scatter_op(self, layer: int, src_word: int, st: L.StreamLayout, t0: int, t_new: int):
        """The scatter of t_new tokens' rows of stream `st` (n_kv × t_new × row_words words
        at src_word of the upload buffer) to tokens t0.. of their KV heads."""
        n = self.layout.n_kv_heads * t_new * st.row_words
        return self._scatter(layer, n).op(src_word=src_word, dst_word=st.region_word + t0 * st.row_words,
                                          row_words=st.row_words, group_rows=t_new,
                                          group_stride=self.layout.n_ctx * st.row_words, n_words=n)

    # --- what the arena's operations (kvdict_vk.vk.attend.engine, .reader) use: its memory, its
    # pipelines, its limits — through these methods, not the fields behind them ------------------
    def layer_buffer(self, layer: int) -> Buffer:
        """The storage buffer of ``layer`` (laid out by self.layout)."""
        return self._layers[self._layer_index(layer)]

    @property
    def upload_buffer(self) -> Buffer:
        """The host-visible buffer appends and decode steps stage their words in."""
        self.check_live()
        return self._upload

    @property
    def upload_words(self) -> int:
        return self._caps["upload"]

    @property
    def read_words(self) -> int:
        """Words one read-back buffer holds at most (larger reads are chunked)."""
        return self._caps["out"]

    @property
    def read_tokens(self) -> int:
        """Tokens (all KV heads, K and V) one read-back buffer holds at most."""
        return self._caps["out"] // self._caps["token_out"]

    def readback_buffer(self, words: int) -> Buffer:
        """The shared read-back buffer of the smallest size class holding ``words``."""
        self.check_live()
        cls = self._out_class(max(words, 1))
        if cls not in self._outs:
            self._outs[cls] = Buffer(self.device, cls, "device", f"read-back buffer ({cls} words)")
        return self._outs[cls]

    def cached_kernel(self, key, make) -> Kernel:
        """The arena's pipeline for ``key``, made by ``make()`` on first use and freed with
        the arena (Kompute binds buffers when a pipeline is made)."""
        self.check_live()
        if key not in self._kernels:
            self._kernels[key] = make()
        return self._kernels[key]

    @property
    def vec4_rows(self) -> bool:
        """Whether rows are read as vec4 (head_dim % 4 == 0) by the read shaders."""
        return self._lanes == 4

    @property
    def row_chunks(self) -> int:
        """copy_rows' CHUNKS (the f32 cache's read): chunks of a row one invocation handles."""
        return self._chunks

    def reconstruct_mapping(self, sparsity: int, atoms_f16: bool = False) -> tuple[int, bool]:
        """reconstruct's (CHUNKS, PIPELINED) for a stream of ``sparsity`` code words gathering
        float32 atoms or (``atoms_f16``) the binary16 copy: output chunks of a row one
        invocation writes (a whole row on CPU drivers) and whether it loads its next row's slot
        words early (RECONSTRUCT_GPU_MAPPINGS, RECONSTRUCT_GPU_MAPPINGS_F16)."""
        if self.shader_mapping == "row":
            return self._chunks_per_row, False
        table = RECONSTRUCT_GPU_MAPPINGS_F16 if atoms_f16 else RECONSTRUCT_GPU_MAPPINGS
        chunks, pipelined = next(m for bound, m in table if bound is None or sparsity <= bound)
        return (chunks if self._chunks_per_row % chunks == 0 else 1), pipelined

    # --- checks -----------------------------------------------------------------------------------
    def check_live(self) -> None:
        """ArenaError once the arena was freed (the arena's own methods and its operations check it)."""
        if self._freed:
            raise E.ArenaError("the arena was freed")

    def _layer_index(self, layer) -> int:
        self.check_live()
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise E.LayerIndexError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.layout.n_layers:
            raise E.LayerIndexError(f"layer {layer} outside 0..{self.layout.n_layers - 1}")
        return int(layer)

    def _rows(self, what: str, a, dtype, width: int) -> np.ndarray:
        if not isinstance(a, np.ndarray) or a.dtype != dtype:
            raise E.ShapeError(f"{what}: expected a {np.dtype(dtype).name} numpy array, got "
                               f"{getattr(a, 'dtype', type(a).__name__)}")
        if a.ndim != 3 or a.shape[0] != self.layout.n_kv_heads or a.shape[2] != width:
            raise E.ShapeError(f"{what}: shape {a.shape}, expected ({self.layout.n_kv_heads}, T, {width})")
        return np.ascontiguousarray(a)

    # --- public API --------------------------------------------------------------------------------
    @property
    def layout(self) -> L.ArenaLayout:
        """Where every word lives (kvdict_vk.layout); fixed for the arena's lifetime."""
        return self._layout

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def closed(self) -> bool:
        return self._freed

    @property
    def seqs(self) -> int:
        """Sequences the arena holds (1 unless made batched)."""
        return self._seqs

    @property
    def seq_ctx(self) -> int:
        """Tokens a sequence holds at most (the n_ctx it was made with)."""
        return self._seq_ctx

    def n_tokens(self, layer: int, seq: int = 0) -> int:
        return self._n_tokens[self._layer_index(layer)][self._seq_index(seq)]

    def _seq_index(self, seq) -> int:
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < self._seqs:
            raise E.ArenaError(f"seq must be an integer in 0..{self._seqs - 1}, got {seq!r}")
        return int(seq)

    def _row0(self, layer: int, seq: int) -> int:
        """The layer row (within a KV head's slice) of the sequence's next token."""
        return seq * self._seq_ctx + self._n_tokens[layer][seq]

    def append(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, seq: int = 0) -> int:
        """Append new tokens' K/V head vectors, float32 (n_kv, T_new, head_dim) each, to
        sequence ``seq``. Coded streams are encoded on the CPU (codec.encode_heads: each KV
        head through its dictionary) or the GPU (``encoder``); only the new slots go to the
        device. Returns the sequence's new token count in the layer."""
        i, seq = self._layer_index(layer), self._seq_index(seq)
        rows = self._new_rows(i, k_rows, v_rows, seq)
        if self._kivi is not None:
            return self._append_kivi(i, rows)
        if self._gpu_encodes(i, rows):
            return self._append_gpu(i, rows, seq)
        return self._append_words(i, *self._encode(i, rows), seq=seq)

    def _append_kivi(self, layer: int, rows) -> int:
        """A KIVI layer's append: its writes planned on the host (kivi_store: the groups that
        leave the exact window quantised, the window's new rows), then written in an order
        that keeps every visible token readable; the host state and the token count move
        only once all is written."""
        t0, t_new = self._n_tokens[layer][0], rows[0].shape[1]
        writes, state = self._kivi.plan(layer, t0, *rows)
        self._write_blocks(layer, writes)
        self._kivi.commit(layer, state)
        self._n_tokens[layer][0] = t0 + t_new
        return t0 + t_new

    def _write_blocks(self, layer: int, writes, what: str | None = None) -> None:
        """kernels.Write blocks to the layer through the upload buffer, in order: as many per
        submission as the buffer holds, a block larger than it split by rows (a row of
        every head — n_kv × row_words ≤ the buffer, _check_limits — fits)."""
        up, cap = self._upload.host_words(), self._caps["upload"]
        what = what or f"appending to layer {layer}"
        ops, used = [], 0
        for w in writes:
            heads, n_rows, row = w.words.shape
            step = max(1, cap // (heads * row))
            for r0 in range(0, n_rows, step):
                part = np.ascontiguousarray(w.words[:, r0:r0 + step])
                if used + part.size > cap:
                    run(self.device, *ops, what=what)
                    ops, used = [], 0
                up[used:used + part.size] = part.reshape(-1)
                ops.append(self._scatter(layer, part.size).op(
                    src_word=used, dst_word=w.dst_word + r0 * row, row_words=row, group_rows=part.shape[1],
                    group_stride=w.group_stride, n_words=part.size))
                used += part.size
        if ops:
            run(self.device, *ops, what=what)

    def _gpu_encodes(self, layer: int, rows) -> bool:
        if not any(st.coded for st in self.layout.layers[layer].streams) or self.encoder == "cpu":
            return False
        return self.encoder == "gpu" or encode_choice.choose(self, layer, rows) == "gpu"

    def stream_dict(self, layer: int, stream: str):
        """The dictionary (codec.StreamDict) a coded stream ("k" / "v") of ``layer`` encodes with."""
        return self._art.stream(layer, stream == "k")

    def gpu_encoder(self, layer: int, st: L.StreamLayout):
        """The GPU OMP encoder of a coded stream (made on first use, freed with the arena)."""
        key = (layer, st.stream)
        if key not in self._encoders:
            from ..encode.encoder import GpuEncoder
            self._encoders[key] = GpuEncoder(self.device, self.stream_dict(layer, st.stream),
                                             max_batch=GPU_ENCODE_BATCH)
        return self._encoders[key]

    def _append_gpu(self, layer: int, rows, seq: int = 0) -> int:
        """Coded streams OMP-encoded on the device straight into their slots — in one
        submission when each stream's rows fit one encoder batch (a decode step's do), so a
        step pays one round trip for both — passthrough rows through the upload buffer. The
        token count moves only when every stream is written, so a failure leaves the layer's
        visible tokens as they were."""
        t0, t_new = self._row0(layer, seq), rows[0].shape[1]
        n_ctx, buf = self.layout.n_ctx, self._layers[layer]
        coded = [(self.gpu_encoder(layer, st), r, st) for r, st in zip(rows, self.layout.layers[layer].streams)
                 if st.coded and t_new]
        if all(enc.one_batch(*r.shape[:2]) for enc, r, _ in coded):
            ops = []
            for enc, r, st in coded:
                if ops:  # disjoint slots, but the same buffer: ordered, for the synchronization validation
                    ops.append(barrier(buf))
                ops += enc.ops_into(buf, r, st.region_word, n_ctx, t0)
            if ops:
                run(self.device, *ops, what="GPU OMP encode")
        else:
            for enc, r, st in coded:
                enc.encode_into(buf, r, st.region_word, n_ctx, t0)
        passthrough = [(L.row_words_of(r, st), st) for r, st in zip(rows, self.layout.layers[layer].streams)
                       if not st.coded]
        if passthrough and t_new:
            self._scatter_words(layer, passthrough, seq)
        self._n_tokens[layer][seq] += t_new
        return self._n_tokens[layer][seq]

    def _new_rows(self, layer: int, k_rows, v_rows, seq: int = 0) -> list:
        """Checked (K, V) rows to append to ``layer``'s sequence ``seq``, with room for them."""
        hd = self.layout.head_dim
        rows = [self._rows(n, a, np.float32, hd) for n, a in (("k_rows", k_rows), ("v_rows", v_rows))]
        self._check_room(layer, rows[0].shape[1], rows[1].shape[1], seq)
        return rows

    def _encode(self, layer: int, rows) -> list:
        """(K, V) rows → the words to store: slots of a coded stream (codec.encode_heads:
        each KV head through its dictionary), the rows' bits for a passthrough one."""
        words = []
        for r, st in zip(rows, self.layout.layers[layer].streams):
            if st.coded:
                words.append(codec.encode_heads(r, self.stream_dict(layer, st.stream)))
            else:
                words.append(L.row_words_of(r, st))
        return words

    def append_codes(self, layer: int, k: np.ndarray, v: np.ndarray, seq: int = 0) -> int:
        """Append already-encoded tokens to sequence ``seq``: uint32 slots (n_kv, T_new,
        slot_words) for a coded stream (codec.encode_heads' output), float32 rows (n_kv,
        T_new, head_dim) for a passthrough stream (stored as f16 in an f16 cache). Slots are
        stored as given (an out-of-range atom index reconstructs as zero)."""
        i, seq = self._layer_index(layer), self._seq_index(seq)
        if self._kivi is not None:  # float32 rows: a KIVI cache quantises them itself
            return self.append(i, k, v)
        words = []
        for n, a, st in zip(("k", "v"), (k, v), self.layout.layers[i].streams):
            if st.coded:
                words.append(self._rows(n, a, np.uint32, st.row_words))
            else:
                words.append(L.row_words_of(self._rows(n, a, np.float32, self.layout.head_dim), st))
        self._check_room(i, words[0].shape[1], words[1].shape[1], seq)
        return self._append_words(i, *words, seq=seq)

    def _check_room(self, layer: int, t_k: int, t_v: int, seq: int = 0) -> None:
        if t_k != t_v:
            raise E.ShapeError(f"K has {t_k} new tokens, V {t_v}")
        t0 = self._n_tokens[layer][seq]
        if t0 + t_k > self._seq_ctx:
            raise E.ArenaError(f"layer {layer}: {t0} + {t_k} tokens exceed n_ctx {self._seq_ctx}"
                               + (f" (sequence {seq})" if self._seqs > 1 else ""))

    def _append_words(self, layer: int, k_words: np.ndarray, v_words: np.ndarray, seq: int = 0) -> int:
        self._scatter_words(layer, list(zip((k_words, v_words), self.layout.layers[layer].streams)), seq)
        self._n_tokens[layer][seq] += k_words.shape[1]
        return self._n_tokens[layer][seq]

    def _scatter_words(self, layer: int, parts, seq: int = 0) -> None:
        """Words (n_kv, T_new, row_words) of the given streams, [(words, StreamLayout)], to
        the sequence's next tokens in the layer (_write_blocks)."""
        self._write_blocks(layer, self._seq_writes(layer, parts, seq))

    def _seq_writes(self, layer: int, parts, seq: int) -> list[Write]:
        """The Writes of words (n_kv, T_new, row_words) of the given streams, [(words,
        StreamLayout)], to sequence ``seq``'s next tokens in the layer (one per stream: a
        block of rows in each KV head's slice)."""
        t0, n_ctx = self._row0(layer, seq), self.layout.n_ctx
        return [Write(st.region_word + t0 * st.row_words, w, n_ctx * st.row_words) for w, st in parts]

    def read(self, layer: int, t0: int = 0, t1: int | None = None, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) float32 (n_kv, t1 − t0, head_dim) for tokens [t0, t1) of sequence ``seq``,
        reconstructed on the GPU."""
        i, t0, t1 = self._range(layer, t0, t1, seq)
        n_kv, hd = self.layout.n_kv_heads, self.layout.head_dim
        k = np.empty((n_kv, t1 - t0, hd), np.float32)
        v = np.empty_like(k)
        step = self.read_tokens
        for c0 in range(t0, t1, step):
            c1 = min(t1, c0 + step)
            k[:, c0 - t0:c1 - t0], v[:, c0 - t0:c1 - t0] = ReadPlan(self, i, c0, c1).run_once()  # rows of the heads' slices
        return k, v

    def read_plan(self, layer: int, t0: int = 0, t1: int | None = None, seq: int = 0) -> ReadPlan:
        """A recorded, re-runnable read of [t0, t1) of sequence ``seq`` (benchmarks:
        dispatch() and readback() separately). The range must fit one read-back buffer."""
        i, t0, t1 = self._range(layer, t0, t1, seq)
        return ReadPlan(self, i, t0, t1)

    def _range(self, layer, t0, t1, seq=0) -> tuple[int, int, int]:
        """(layer index, first row, end row) of tokens [t0, t1) of sequence ``seq``: rows of
        a KV head's slice (sequence s starts at row s · seq_ctx)."""
        i, seq = self._layer_index(layer), self._seq_index(seq)
        n = self._n_tokens[i][seq]
        t1 = n if t1 is None else t1
        for name, t in (("t0", t0), ("t1", t1)):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise E.ArenaError(f"{name} must be an integer, got {t!r}")
        if not 0 <= t0 <= t1:
            raise E.ArenaError(f"token range [{t0}, {t1}) is empty-inverted or negative")
        if t1 > self._seq_ctx:
            raise E.ArenaError(f"token range [{t0}, {t1}) exceeds n_ctx {self._seq_ctx}")
        if t1 > n:
            raise E.ArenaError(f"token range [{t0}, {t1}) exceeds the {n} tokens appended to layer {i}")
        base = seq * self._seq_ctx
        return i, base + int(t0), base + int(t1)

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float | None = None) -> np.ndarray:
        """Decode attention of one new query token over the layer's first ``n_used`` cached
        tokens: q (n_heads, head_dim) float32 with n_heads a multiple of n_kv_heads (query
        head h reads KV head h // (n_heads / n_kv_heads)); softmax(scale · q·k), scale
        defaulting to 1/sqrt(head_dim). Returns (n_heads, head_dim) float32. The same call
        in both cache modes: over f32 rows, or straight over the codes (K and V are never
        materialised) — see kvdict_vk.vk.attend.engine."""
        i = self._layer_index(layer)
        self._one_sequence("attend")
        q, n_used, scale = check_query(self.layout, q, n_used, self._n_tokens[i][0], scale)
        return self.attention(q.shape[0]).attend(i, q, n_used, scale)

    def attend_batch(self, layer: int, q: np.ndarray, n_used, scale: float | None = None) -> np.ndarray:
        """Batched decode attention: q (B, n_heads, head_dim) float32, sequence b's query
        heads over its first n_used[b] cached tokens (1 ≤ n_used[b] ≤ its token count), for
        sequences 0 .. B − 1 of a batched arena (B ≤ seqs) — every sequence in the same
        dispatches (the flash kernels; the dictionaries' reads shared), as ``attend`` per
        sequence otherwise. Returns (B, n_heads, head_dim) float32."""
        i = self._layer_index(layer)
        if not isinstance(q, np.ndarray) or q.ndim != 3 or not 1 <= q.shape[0] <= self._seqs:
            raise E.ShapeError(f"attend_batch: q must be (B, n_heads, head_dim) with 1 ≤ B ≤ {self._seqs}, got "
                               f"{getattr(q, 'shape', type(q).__name__)}")
        used = np.asarray(n_used)
        if used.shape != (q.shape[0],) or used.dtype.kind not in "iu":
            raise E.ArenaError(f"attend_batch: n_used must be {q.shape[0]} integers, got {n_used!r}")
        for b in range(q.shape[0]):
            check_query(self.layout, q[b], int(used[b]), self._n_tokens[i][b], scale)
        scale = check_scale(scale, self.layout.head_dim)
        return self.attention(q.shape[1]).attend_batch(i, q, [int(u) for u in used], scale)

    def step_batch(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray,
                   scale: float | None = None) -> np.ndarray:
        """One decode step of a batch: k_rows / v_rows float32 (B, n_kv, T_new, head_dim) —
        sequence b's new tokens, the same count for each — appended to sequences 0 .. B − 1,
        then ``attend_batch`` with q (B, n_heads, head_dim) over every sequence's tokens, the
        new ones included. The appends go up in one submission where the encoder is the CPU
        codec or the cache is uncoded (every sequence's words in one scatter), one per sequence
        with the GPU encoder; the attention in one more. Every sequence is checked for room
        before anything is written; a failure leaves every sequence's visible tokens as they
        were. Returns (B, n_heads, head_dim) float32."""
        i = self._layer_index(layer)
        for what, a in (("k_rows", k_rows), ("v_rows", v_rows)):
            if not isinstance(a, np.ndarray) or a.ndim != 4 or not 1 <= a.shape[0] <= self._seqs:
                raise E.ShapeError(f"step_batch: {what} must be (B, n_kv, T_new, head_dim) with 1 ≤ B ≤ "
                                   f"{self._seqs}, got {getattr(a, 'shape', type(a).__name__)}")
        if k_rows.shape[0] != v_rows.shape[0] or not isinstance(q, np.ndarray) or q.ndim != 3 \
                or q.shape[0] != k_rows.shape[0]:
            raise E.ShapeError(f"step_batch: K, V and q must hold the same sequences, got {k_rows.shape[0]}, "
                               f"{v_rows.shape[0]} and {getattr(q, 'shape', None)}")
        batch = k_rows.shape[0]
        rows = [self._new_rows(i, k_rows[b], v_rows[b], b) for b in range(batch)]
        n_new = rows[0][0].shape[1]
        n_used = [self._n_tokens[i][b] + n_new for b in range(batch)]
        for b in range(batch):  # q, scale and each sequence's tokens checked before anything is written
            check_query(self.layout, q[b], n_used[b], n_used[b], scale)
        if self._gpu_encodes(i, rows[0]):
            # a sequence at a time: the encoder stages its rows for one destination range
            for b, r in enumerate(rows):
                self._append_gpu(i, r, b)
        else:
            # every sequence's rows encoded in one call (a token per sequence is one OMP batch
            # of B vectors per KV head, not B calls), written in one scatter
            streams = self.layout.layers[i].streams
            words = self._encode(i, [np.concatenate([r[s] for r in rows], axis=1) for s in (0, 1)])
            self._write_blocks(i, [wr for b in range(batch) for wr in self._seq_writes(
                i, [(w[:, b * n_new:(b + 1) * n_new], st) for w, st in zip(words, streams)], b)])
            for b in range(batch):
                self._n_tokens[i][b] += n_new
        return self.attention(q.shape[1]).attend_batch(i, q, n_used, check_scale(scale, self.layout.head_dim))

    def _one_sequence(self, what: str) -> None:
        if self._seqs > 1:
            raise E.ArenaError(f"{what} serves an arena of one sequence; this one holds {self._seqs}: "
                               f"append(seq=…) and attend_batch")

    def step(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray,
             scale: float | None = None) -> np.ndarray:
        """One decode step: append the new tokens' K/V (as ``append``), then attend with q
        over every token of the layer, the new ones included (as ``attend`` with n_used =
        the new token count) — in ONE submission: the scatter into the layer and the
        attention passes, which read the new tokens from the upload buffer (kvdict_vk.vk.attend.engine
        says why). Returns (n_heads, head_dim) float32. Same call in both cache modes."""
        i = self._layer_index(layer)
        self._one_sequence("step")
        rows = self._new_rows(i, k_rows, v_rows)
        t0, t_new = self._n_tokens[i][0], rows[0].shape[1]
        q, n_used, scale = check_query(self.layout, q, max(t0 + t_new, 1), t0 + t_new, scale)
        att = self.attention(q.shape[0])
        if self._kivi is not None:  # append, then attend: two submissions
            self._append_kivi(i, rows)
            return att.attend(i, q, n_used, scale)
        if self._gpu_encodes(i, rows):
            self._append_gpu(i, rows)  # the slots are made on the device: two submissions
            return att.attend(i, q, n_used, scale)
        k_words, v_words = self._encode(i, rows)  # after every check: OMP is the expensive part
        k_st, v_st = self.layout.layers[i].streams
        n_kv = self.layout.n_kv_heads
        v_word = -(-n_kv * t_new * k_st.row_words // 4) * 4  # f32 rows are read as vec4
        v_end = v_word + n_kv * t_new * v_st.row_words
        if t_new == 0 or t_new > att.max_fresh_tokens(i) or v_end > self._caps["upload"]:
            self._append_words(i, k_words, v_words)  # a prefill: two submissions
            return att.attend(i, q, n_used, scale)
        up = self._upload.host_words()
        up[:k_words.size] = k_words.reshape(-1)
        up[v_word:v_end] = v_words.reshape(-1)
        # the attention reads tokens [0, t0) of the layer the scatter writes [t0, t0 + t_new)
        # of: disjoint words, but one binding — the barrier keeps that plain to any checker
        if i not in self._step_barriers:
            self._step_barriers[i] = barrier(self._layers[i])
        scatter = [self._scatter_op(i, 0, k_st, t0, t_new), self._scatter_op(i, v_word, v_st, t0, t_new),
                   self._step_barriers[i]]
        out = att.step(i, q, t0, t_new, scale, scatter, (0, v_word))
        self._n_tokens[i][0] = t0 + t_new
        return out

    def attention(self, n_heads: int) -> Attention:
        """The attention engine for ``n_heads`` query heads (benchmarks use it directly)."""
        self.check_live()
        if n_heads not in self._attention:
            self._attention[n_heads] = Attention(self, n_heads)
        return self._attention[n_heads]

    def layer_words(self, layer: int) -> np.ndarray:
        """A copy of a layer buffer's raw words (uint32), for tests and the dump tool."""
        i = self._layer_index(layer)
        src = self._layers[i]
        dst = Buffer(self.device, src.words, "device", f"layer {i} read-back")
        kernel = Kernel(self.device, "copy_scalar", [src, dst], max_items=src.words)
        try:
            run(self.device, kernel.op(src_word=0, dst_word=0, n_words=src.words),
                kp.OpTensorSyncLocal([dst.tensor]), what=f"reading layer {i} back")
            return np.array(dst.host_words(), np.uint32)
        finally:
            kernel.destroy()
            dst.destroy()

    def free(self) -> None:
        """Release every device resource. Idempotent; any later use raises ArenaError."""
        if self._freed:
            return
        self._freed = True
        for att in self._attention.values():
            att.free()
        self._attention.clear()
        for enc in self._encoders.values():
            enc.free()
        self._encoders.clear()
        self._step_barriers.clear()
        for k in list(self._kernels.values()):
            k.destroy()
        for b in [*self._outs.values(), *self._layers, self._upload]:
            if b is not None:
                b.destroy()
        self._kernels.clear()
        self._outs.clear()
        self._layers = []
        self._upload = None

    def __enter__(self) -> "KvArena":
        self.check_live()
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"{self.layout.total_bytes} bytes"
        return (f"KvArena({self.mode}, layers={self.layout.n_layers}, n_kv={self.layout.n_kv_heads}, "
                f"head_dim={self.layout.head_dim}, n_ctx={self.layout.n_ctx}, {state}, {self.device.name})")
