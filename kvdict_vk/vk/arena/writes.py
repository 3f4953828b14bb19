"""How words reach an arena's layers: the scatter shader from the upload buffer, fed by
three append paths —

* the CPU codec (codec.encode_heads: OMP per KV head, then the residual stage) for coded
  streams, raw rows (f32, f16, q8_0 words) for passthrough ones: only the new slots or rows
  go through the upload buffer, as many per submission as it holds;
* the GPU OMP encoder (kvdict_vk.vk.encode.encoder), writing slots straight into the layer
  (encoder "gpu", or "auto" where kvdict_vk.vk.encode.choice measured it faster);
* the KIVI store (kivi_store): the writes planned on the host, in an order that keeps every
  visible token readable.

A layer's token count moves only once all of an append is written, so a failure leaves the
tokens a layer shows as they were. Also the layers' first image (tails, guard sentinels).
"""
from __future__ import annotations

import contextlib

import numpy as np

from ... import codec
from ... import errors as E
from ... import kivi as K
from ... import layout as L
from ... import rows as R
from ..encode import choice as encode_choice
from ..kernels import Kernel, Write, barrier, pipeline, run
from . import config as C
from .kivi_store import KiviStore
from .memory import ArenaMemory


class ArenaWrites:
    """The write paths of one arena, on its ``memory``: ``art`` the dictionaries of a
    dict-coded arena (else None), ``encoder`` "cpu" / "gpu" / "auto" (KvArena's)."""

    def __init__(self, memory: ArenaMemory, art, encoder: str):
        self.memory, self.layout, self.encoder = memory, memory.layout, encoder
        self._art = art
        self._kivi = KiviStore(self.layout, self._read_kivi_window) if self.layout.mode == L.KIVI_CACHE else None
        self._encoders: dict = {}  # (layer, "k"/"v") → GpuEncoder, made on first GPU-encoded append
        self._step_barriers: dict = {}  # layer → the barrier after a step's scatter (made once)
        # (layer, small) → the device's scatter pipeline: looked up once, not on every append
        self._scatters: dict = {}

    @property
    def kivi(self) -> bool:
        """Whether the arena is a KIVI cache (its appends quantise float32 rows themselves)."""
        return self._kivi is not None

    # --- setup ------------------------------------------------------------------------------------
    def init_layers(self, flat) -> None:
        """Upload every layer's tail (atoms ``flat``, means, residual scales); in guard mode,
        the whole layer: sentinels everywhere except the tail blocks."""
        for ll in self.layout.layers:
            self._init_layer(ll, flat)

    def _init_layer(self, ll: L.LayerLayout, flat) -> None:
        if ll.k.kivi:  # every sequence's quantised end starts at 0 (storage buffers start undefined)
            image = np.full(ll.total_words, self.layout.guard_value, np.uint32) if ll.guard_spans else None
            if image is None:
                self._write_words(ll.index, ll.k.state_word, np.zeros(ll.k.kivi_seqs, np.uint32))
            else:
                image[ll.k.state_word:ll.k.state_word + ll.k.kivi_seqs] = 0
                self._write_words(ll.index, 0, image)
            return
        if ll.tail_word is None and not ll.guard_spans:
            return
        lay = self.layout
        if ll.tail_word is not None:
            pair = self._art.layers[ll.index]
            means = tuple(None if d is None else d.mean for d in pair)
            scales = tuple(None if d is None else d.residual_scale for d in pair)
            tail = R.layer_tail_image(lay, ll.index, flat, means, scales)
        state = (ll.k.state_word or ll.v.state_word) if ll.windowed else None  # a window's: no token yet
        if ll.guard_spans:
            image = np.full(ll.total_words, lay.guard_value, np.uint32)
            if ll.tail_word is not None:
                image[ll.tail_word:ll.tail_word + ll.tail_words] = tail
            if state is not None:
                image[state] = 0
            self._write_words(ll.index, 0, image)
        else:
            self._write_words(ll.index, ll.tail_word, tail)
            if state is not None:
                self._write_words(ll.index, state, np.zeros(1, np.uint32))

    @contextlib.contextmanager
    def kivi_state_at(self, layers, n_tokens: int):
        """Within: every KIVI layer of ``layers`` holds, for each sequence, the quantised end a
        cache of ``n_tokens`` tokens has (kivi.quantised_end); after, the state words it held
        before. For the tuner: a KIVI plan timed at n_tokens over the arena as it is would put
        every token past its quantised end — the whole context over an empty arena — in the
        exact window's split, which a decode never holds more than a window in."""
        lay, saved = self.memory.layout, []
        try:
            for i in layers:
                k = lay.layers[i].k
                if k.kivi:
                    saved.append((i, k.state_word, self.memory.layer_words(i, k.state_word, k.kivi_seqs)))
                    end = K.quantised_end(n_tokens, lay.kivi.recent)
                    self._write_words(i, k.state_word, np.full(k.kivi_seqs, end, np.uint32))
            yield
        finally:
            for i, word, words in saved:
                self._write_words(i, word, words)

    def _write_words(self, layer: int, dst_word: int, words: np.ndarray) -> None:
        """Contiguous words (a tail or guard image, a state word) at dst_word of the layer."""
        self.write_blocks(layer, [Write(dst_word, words.reshape(1, -1, 1), 0)], what=f"uploading layer {layer}")

    # --- the scatter ------------------------------------------------------------------------------
    def _scatter(self, layer: int, n_words: int | None = None) -> Kernel:
        """The scatter pipeline for an upload of n_words (None: any size). Two sizes: a
        dispatch is sized when its pipeline is made, and llvmpipe pays for every workgroup
        even when its grid-stride loop has nothing to do, so a one-token append through the
        upload-sized pipeline would cost milliseconds."""
        mem = self.memory
        mem.check_live()
        small_words = mem.token_upload_words * C.SMALL_SCATTER_TOKENS
        small = n_words is not None and n_words <= small_words
        made = self._scatters.get((layer, small))
        if made is None:
            made = self._scatters[(layer, small)] = pipeline(
                mem.device, "scatter", [mem.upload_buffer, mem.layer_buffer(layer)],
                max_items=small_words if small else mem.upload_words)
        return made

    def _scatter_op(self, layer: int, src_word: int, st: L.StreamLayout, t0: int, t_new: int):
        """The scatter of t_new tokens' rows of stream `st` (n_kv × t_new × row_words words
        at src_word of the upload buffer) to tokens t0.. of their KV heads."""
        n = self.layout.n_kv_heads * t_new * st.row_words
        return self._scatter(layer, n).op(src_word=src_word, dst_word=st.region_word + t0 * st.row_words,
                                          row_words=st.row_words, group_rows=t_new,
                                          group_stride=self.layout.n_ctx * st.row_words, n_words=n)

    def write_blocks(self, layer: int, writes, what: str | None = None) -> None:
        """kernels.Write blocks to the layer through the upload buffer, in order: as many per
        submission as the buffer holds, a block larger than it split by rows (a row of
        every head — n_kv × row_words ≤ the buffer, ArenaMemory's limits — fits)."""
        up, cap = self.memory.upload_buffer.host_words(), self.memory.upload_words
        what = what or f"appending to layer {layer}"
        ops, used = [], 0
        for w in writes:
            heads, n_rows, row = w.words.shape
            step = max(1, cap // (heads * row))
            for r0 in range(0, n_rows, step):
                part = np.ascontiguousarray(w.words[:, r0:r0 + step])
                if used + part.size > cap:
                    run(self.memory.device, *ops, what=what)
                    ops, used = [], 0
                up[used:used + part.size] = part.reshape(-1)
                ops.append(self._scatter(layer, part.size).op(
                    src_word=used, dst_word=w.dst_word + r0 * row, row_words=row, group_rows=part.shape[1],
                    group_stride=w.group_stride, n_words=part.size))
                used += part.size
        if ops:
            run(self.memory.device, *ops, what=what)

    def _seq_writes(self, layer: int, parts, seq: int) -> list[Write]:
        """The Writes of words (n_kv, T_new, row_words) of the given streams, [(words,
        StreamLayout)], to sequence ``seq``'s next tokens in the layer (one per stream: a
        block of rows in each KV head's slice)."""
        t0, n_ctx = self.memory.row0(layer, seq), self.layout.n_ctx
        return [Write(st.region_word + t0 * st.row_words, w, n_ctx * st.row_words) for w, st in parts]

    # --- checks -----------------------------------------------------------------------------------
    def rows(self, what: str, a, dtype, width: int) -> np.ndarray:
        """``a`` checked as (n_kv, T, width) of ``dtype``, contiguous."""
        if not isinstance(a, np.ndarray) or a.dtype != dtype:
            raise E.ShapeError(f"{what}: expected a {np.dtype(dtype).name} numpy array, got "
                               f"{getattr(a, 'dtype', type(a).__name__)}")
        if a.ndim != 3 or a.shape[0] != self.layout.n_kv_heads or a.shape[2] != width:
            raise E.ShapeError(f"{what}: shape {a.shape}, expected ({self.layout.n_kv_heads}, T, {width})")
        return np.ascontiguousarray(a)

    def check_room(self, layer: int, t_k: int, t_v: int, seq: int = 0) -> None:
        if t_k != t_v:
            raise E.ShapeError(f"K has {t_k} new tokens, V {t_v}")
        mem = self.memory
        t0 = mem.n_tokens(layer, seq)
        if t0 + t_k > mem.seq_ctx:
            raise E.ArenaError(f"layer {layer}: {t0} + {t_k} tokens exceed n_ctx {mem.seq_ctx}"
                               + (f" (sequence {seq})" if mem.seqs > 1 else ""))

    def new_rows(self, layer: int, k_rows, v_rows, seq: int = 0) -> list:
        """Checked (K, V) rows to append to ``layer``'s sequence ``seq``, with room for them."""
        hd = self.layout.head_dim
        rows = [self.rows(n, a, np.float32, hd) for n, a in (("k_rows", k_rows), ("v_rows", v_rows))]
        self.check_room(layer, rows[0].shape[1], rows[1].shape[1], seq)
        return rows

    # --- the append paths -------------------------------------------------------------------------
    def append(self, layer: int, rows, seq: int = 0) -> int:
        """Checked (K, V) float32 rows (new_rows) appended to sequence ``seq`` by the arena's
        path: KIVI, the GPU encoder, or encoded on the CPU and scattered."""
        if self._kivi is not None:
            return self.append_kivi(layer, rows, seq)
        if self.gpu_encodes(layer, rows):
            return self.append_gpu(layer, rows, seq)
        return self.append_words(layer, *self.encode(layer, rows, self.memory.n_tokens(layer, seq)),
                                 seq=seq, rows=rows)

    def append_batch(self, layer: int, rows) -> None:
        """Checked rows [(K, V)] of sequences 0 .. B − 1, the same count each, appended."""
        if self.layout.layers[layer].windowed:  # one sequence (KvArena refuses more)
            self.append(layer, rows[0], 0)
            return
        if self._kivi is not None:  # every sequence's groups and rings planned on the host, one upload
            self._append_kivi(layer, list(enumerate(rows)))
            return
        if self.gpu_encodes(layer, rows[0]):
            # a sequence at a time: the encoder stages its rows for one destination range
            for b, r in enumerate(rows):
                self.append_gpu(layer, r, b)
            return
        # every sequence's rows encoded in one call (a token per sequence is one OMP batch
        # of B vectors per KV head, not B calls), written in one scatter
        # (keys coded before RoPE turned back from each sequence's own positions first)
        n_new, streams = rows[0][0].shape[1], self.layout.layers[layer].streams
        positions = np.concatenate([np.arange(n_new) + self.memory.n_tokens(layer, b) for b in range(len(rows))])
        words = self.encode(layer, [np.concatenate([r[s] for r in rows], axis=1) for s in (0, 1)], positions)
        self.write_blocks(layer, [wr for b in range(len(rows)) for wr in self._seq_writes(
            layer, [(w[:, b * n_new:(b + 1) * n_new], st) for w, st in zip(words, streams)], b)])
        for b in range(len(rows)):
            self.memory.advance(layer, b, n_new)

    def append_words(self, layer: int, k_words: np.ndarray, v_words: np.ndarray, seq: int = 0,
                     rows=None) -> int:
        """Words (n_kv, T_new, row_words) of K and V, already checked, scattered to the sequence;
        ``rows`` the float32 rows they code (a windowed layer's window takes them)."""
        self._scatter_words(layer, list(zip((k_words, v_words), self.layout.layers[layer].streams)), seq)
        return self._advance(layer, seq, k_words.shape[1], rows)

    def _advance(self, layer: int, seq: int, t_new: int, rows) -> int:
        """The append's last writes — a windowed layer's state word, then its window's new rows
        (in that order, so every visible token stays readable) — then the token count."""
        if self.layout.layers[layer].windowed:
            if rows is None:
                raise E.ArenaError(f"layer {layer}: a windowed append needs the float32 rows")
            self.write_blocks(layer, self._window_writes(layer, rows, self.memory.n_tokens(layer, seq)))
        return self.memory.advance(layer, seq, t_new)

    def _window_writes(self, layer: int, rows, t0: int) -> list[Write]:
        """The Writes of an append of ``rows`` at token t0 to a windowed layer: the state word
        (the new token count), then each coded stream's new sink and recent tokens' binary16
        rows at their window rows (kvdict_vk.window), a Write per contiguous run."""
        ll = self.layout.layers[layer]
        n = t0 + rows[0].shape[1]
        writes = [Write(ll.k.state_word or ll.v.state_word, np.full((1, 1, 1), n, np.uint32), 0)]
        for r, st in zip(rows, ll.streams):
            if not st.windowed:
                continue
            win, half_row = st.exact_window, self.layout.head_dim // 2
            new = np.flatnonzero(win.exact(n, t0))  # of the new tokens, those the window keeps
            if not new.size:
                continue
            words = np.ascontiguousarray(r[:, new]).astype(np.float16).view(np.uint32)
            at = win.row_of(t0 + new)
            for run in np.split(np.arange(new.size), np.flatnonzero(np.diff(at) != 1) + 1):
                writes.append(Write(st.window_word + int(at[run[0]]) * half_row, words[:, run[0]:run[-1] + 1],
                                    win.rows * half_row))
        return writes

    def _scatter_words(self, layer: int, parts, seq: int = 0) -> None:
        """Words (n_kv, T_new, row_words) of the given streams, [(words, StreamLayout)], to
        the sequence's next tokens in the layer (write_blocks)."""
        self.write_blocks(layer, self._seq_writes(layer, parts, seq))

    def append_kivi(self, layer: int, rows, seq: int = 0) -> int:
        """A KIVI layer's append to a sequence: its writes planned on the host (kivi_store: the
        groups that leave the exact window quantised, the window's new rows), then written in
        an order that keeps every visible token readable; the host state and the token count
        move only once all is written."""
        self._append_kivi(layer, [(seq, rows)])
        return self.memory.n_tokens(layer, seq)

    def _append_kivi(self, layer: int, seq_rows) -> None:
        """append_kivi of [(sequence, rows)], every sequence's writes (each in its order) in one
        write_blocks."""
        plans = [(seq, rows, *self._kivi.plan(layer, seq, self.memory.n_tokens(layer, seq), *rows))
                 for seq, rows in seq_rows]
        self.write_blocks(layer, [w for _, _, writes, _ in plans for w in writes])
        for seq, rows, _, state in plans:
            self._kivi.commit(layer, seq, state)
            self.memory.advance(layer, seq, rows[0].shape[1])

    def kivi_appended_on_device(self, layers, batch: int = 1) -> None:
        """A recorded step's appends to sequences 0 .. batch − 1 of KIVI layers, made on the
        device (kivi_store)."""
        self._kivi.appended_on_device(layers, batch)

    def _read_kivi_window(self, layer: int, seq: int, t0: int, t1: int) -> tuple:
        """The KIVI layer's window rows of tokens [t0, t1) of a sequence, read back from the
        device (float32 of their binary16 values, (n_kv, t1 − t0, head_dim) each)."""
        lay = self.layout
        hd, n_kv = lay.head_dim, lay.n_kv_heads
        out = []
        for st in lay.layers[layer].streams:  # the rings only, not the layer
            ring = self.memory.layer_words(layer, st.window_word, st.window_words).reshape(
                n_kv, st.kivi_seqs, st.window_tokens, hd // 2)  # KIVI heads g · seqs + s (kivi_head)
            rows = ring[:, seq, np.arange(t0, t1) % st.window_tokens]
            out.append(np.ascontiguousarray(rows).view(np.float16).astype(np.float32).reshape(n_kv, t1 - t0, hd))
        return tuple(out)

    def gpu_encodes(self, layer: int, rows) -> bool:
        """Whether the GPU encoder writes these rows' coded streams (encoder "auto": choice)."""
        if not any(st.coded for st in self.layout.layers[layer].streams) or self.encoder == "cpu":
            return False
        return self.encoder == "gpu" or encode_choice.choose(
            self.memory, layer, rows, self.stream_dict, self.gpu_encoder) == "gpu"

    def stream_dict(self, layer: int, stream: str):
        """The dictionary (codec.StreamDict) a coded stream ("k" / "v") of ``layer`` encodes with."""
        return self._art.stream(layer, stream == "k")

    def gpu_encoder(self, layer: int, st: L.StreamLayout):
        """The GPU OMP encoder of a coded stream (made on first use, freed with the arena)."""
        key = (layer, st.stream)
        if key not in self._encoders:
            from ..encode.encoder import GpuEncoder
            self._encoders[key] = GpuEncoder(self.memory.device, self.stream_dict(layer, st.stream),
                                             max_batch=C.GPU_ENCODE_BATCH)
        return self._encoders[key]

    def append_gpu(self, layer: int, rows, seq: int = 0) -> int:
        """Coded streams OMP-encoded on the device straight into their slots — in one
        submission when each stream's rows fit one encoder batch (a decode step's do), so a
        step pays one round trip for both — passthrough rows through the upload buffer. The
        token count moves only when every stream is written, so a failure leaves the layer's
        visible tokens as they were."""
        t0, t_new = self.memory.row0(layer, seq), rows[0].shape[1]
        n_ctx, buf = self.layout.n_ctx, self.memory.layer_buffer(layer)
        coded = [(self.gpu_encoder(layer, st), r, st) for r, st in
                 zip(self.coding_rows(layer, rows, self.memory.n_tokens(layer, seq)), self.layout.layers[layer].streams)
                 if st.coded and t_new]
        if all(enc.one_batch(*r.shape[:2]) for enc, r, _ in coded):
            ops = []
            for enc, r, st in coded:
                if ops:  # disjoint slots, but the same buffer: ordered, for the synchronization validation
                    ops.append(barrier(buf))
                ops += enc.ops_into(buf, r, st.region_word, n_ctx, t0)
            if ops:
                run(self.memory.device, *ops, what="GPU OMP encode")
        else:
            for enc, r, st in coded:
                enc.encode_into(buf, r, st.region_word, n_ctx, t0)
        passthrough = [(R.row_words_of(r, st), st) for r, st in zip(rows, self.layout.layers[layer].streams)
                       if not st.coded]
        if passthrough and t_new:
            self._scatter_words(layer, passthrough, seq)
        return self._advance(layer, seq, t_new, rows)

    def coding_rows(self, layer: int, rows, t0) -> list:
        """(K, V) rows of tokens t0 … (or at the array t0's positions: KeyRope.rotate) as their
        streams code them: keys coded before RoPE turned back to position 0 (kvdict_vk.rope),
        float32; every other stream's rows as given."""
        return [r if st.key_rope is None else st.key_rope.unturn(r, t0)
                for r, st in zip(rows, self.layout.layers[layer].streams)]

    def encode(self, layer: int, rows, t0) -> list:
        """(K, V) rows of tokens t0 … (or at the array t0's positions) → the words to store:
        slots of a coded stream (codec.encode_heads of its coding_rows: each KV head through its
        dictionary), the rows' bits for a passthrough one."""
        words = []
        for r, st in zip(self.coding_rows(layer, rows, t0), self.layout.layers[layer].streams):
            if st.coded:
                words.append(codec.encode_heads(r, self.stream_dict(layer, st.stream)))
            else:
                words.append(R.row_words_of(r, st))
        return words

    # --- a decode step's scatter --------------------------------------------------------------
    def stage_step(self, layer: int, k_words: np.ndarray, v_words: np.ndarray):
        """A step's new words (sequence 0) staged in the upload buffer — K at word 0, V after
        it, vec4-aligned (f32 rows are read as vec4) — and the ops that scatter them into the
        layer, then a barrier: (ops, (k_word, v_word)) for the attention to read them from the
        upload buffer; None (nothing staged) where they do not fit it."""
        k_st, v_st = self.layout.layers[layer].streams
        t0, t_new = self.memory.n_tokens(layer), k_words.shape[1]
        n_kv = self.layout.n_kv_heads
        v_word = -(-n_kv * t_new * k_st.row_words // 4) * 4
        v_end = v_word + n_kv * t_new * v_st.row_words
        if v_end > self.memory.upload_words:
            return None
        up = self.memory.upload_buffer.host_words()
        up[:k_words.size] = k_words.reshape(-1)
        up[v_word:v_end] = v_words.reshape(-1)
        # the attention reads tokens [0, t0) of the layer the scatter writes [t0, t0 + t_new)
        # of: disjoint words, but one binding — the barrier keeps that plain to any checker
        if layer not in self._step_barriers:
            self._step_barriers[layer] = barrier(self.memory.layer_buffer(layer))
        ops = [self._scatter_op(layer, 0, k_st, t0, t_new), self._scatter_op(layer, v_word, v_st, t0, t_new),
               self._step_barriers[layer]]
        return ops, (0, v_word)

    def free(self) -> None:
        """Free the GPU encoders; forget the step barriers."""
        for enc in self._encoders.values():
            enc.free()
        self._encoders.clear()
        self._step_barriers.clear()
        self._scatters.clear()
