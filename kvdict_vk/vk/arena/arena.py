"""The KV arena on the GPU: one storage buffer per layer, laid out by kvdict_vk.layout.

The runtime snapshot is read ONCE, at creation: active → the dict-coded layout, with each
layer's atoms, means and residual scales uploaded into its tail (an artifact that does not
fit the model is refused with DictMismatchError); otherwise the default f32 cache. Both
modes have the same API. Appends encode on the CPU (codec.encode_heads: OMP per KV head,
then the residual stage) and send ONLY the new slots — or raw f32 rows — through a small
host-visible upload buffer to the scatter shader. Reads reconstruct on the GPU (or copy
passthrough rows) into a read-back buffer; only the output crosses back. Decode attention
over the cache (both modes, one call) lives in kvdict_vk.vk.attend.engine.

KvArena is the façade over its wings, each given the arena's memory (memory.ArenaMemory:
the device, the layout, the buffers, the pipeline cache, the token counts) and nothing more:
the write paths (writes.ArenaWrites), the reads (kvdict_vk.vk.read.reader) and the
attention engines (kvdict_vk.vk.attend.engine.Attention); config resolves what it is made with.

Not thread-safe: one arena belongs to one thread at a time.
"""
from __future__ import annotations

import numpy as np

from ... import runtime
from ... import errors as E
from ... import layout as L
from ... import rows as R
from ..device import Device, get_device
from ...kivi import KiviSpec
from ..attend.engine import Attention, check_query, check_scale
from ..read import reader
from ..read.reader import ReadPlan
from . import config as C
from .decode import DecodeStep
from .memory import ArenaMemory
from .writes import ArenaWrites


class KvArena:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, *,
                 device: "int | str | Device | None" = None, shader_mapping: str | None = None,
                 guard_words: int = 0, guard_value: int = L.DEFAULT_GUARD_VALUE, encoder: str | None = None,
                 cache: str | None = None, kivi: KiviSpec | None = None, seqs: int = 1,
                 dictionary_part=None):
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
        slice holds sequence s at rows s·n_ctx .. (s+1)·n_ctx − 1, docs/ARENA.md).
        ``dictionary_part``: a dict cache's part of the installed artifact this arena holds in
        its place (kvdict_vk.vk.split: a device's layers or KV heads of it; split.artifact_part)."""
        C.check_seqs(seqs, n_ctx)
        self.encoder = C.resolve_encoder(encoder)
        snap = runtime.snapshot()  # once: the layout never changes under a live arena
        cache = C.resolve_cache(cache, snap.active)
        art = snap.artifact if cache == "dict" else None
        if dictionary_part is not None:  # fail-closed still: only a part cut from what is installed
            if cache != "dict" or getattr(dictionary_part, "part_of", None) is not snap.artifact:
                raise E.ArenaError("dictionary_part must be cut from the installed artifact "
                                   "(kvdict_vk.vk.split.artifact_part) for a dict cache")
            art = dictionary_part
        if art is not None and art.window and seqs > 1:
            raise E.ArenaError(f"a dictionary cache with an exact window ({art.window.describe()}) holds one "
                               f"sequence; asked for {seqs}")
        if kivi is not None and cache != L.KIVI_CACHE:
            raise E.ArenaError(f"kivi settings given for a {cache!r} cache")
        layout = L.build_layout(n_layers, n_kv_heads, head_dim, n_ctx * int(seqs), art,
                                guard_words=guard_words, guard_value=guard_value,
                                cache=L.DEFAULT_CACHE if cache == "dict" else cache, kivi=kivi, seqs=int(seqs))
        self._attention: dict[int, Attention] = {}  # by query-head count, made on first attend
        self._steps: list[DecodeStep] = []  # record_step's, freed with the arena
        # sized against the device (ArenaTooLargeError) before anything is allocated
        self.memory = ArenaMemory(layout, get_device(device), shader_mapping, seqs, n_ctx)
        self._writes = ArenaWrites(self.memory, art, self.encoder)
        try:  # the atoms go up once (= runtime.atoms_flat() of the snapshot); the arena keeps no host copy
            self._writes.init_layers(None if art is None else art.atoms_flat())
        except BaseException:
            self.free()
            raise

    # --- what it is -------------------------------------------------------------------------------
    @property
    def layout(self) -> L.ArenaLayout:
        """Where every word lives (kvdict_vk.layout); fixed for the arena's lifetime."""
        return self.memory.layout

    @property
    def device(self) -> Device:
        return self.memory.device

    @property
    def shader_mapping(self) -> str:
        """"row" (one invocation per row: CPU drivers) or "chunk" (GPUs), as made."""
        return self.memory.shader_mapping

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def closed(self) -> bool:
        return self.memory.closed

    @property
    def seqs(self) -> int:
        """Sequences the arena holds (1 unless made batched)."""
        return self.memory.seqs

    @property
    def seq_ctx(self) -> int:
        """Tokens a sequence holds at most (the n_ctx it was made with)."""
        return self.memory.seq_ctx

    def n_tokens(self, layer: int, seq: int = 0) -> int:
        return self.memory.n_tokens(layer, seq)

    def stream_dict(self, layer: int, stream: str):
        """The dictionary (codec.StreamDict) a coded stream ("k" / "v") of ``layer`` encodes with."""
        return self._writes.stream_dict(layer, stream)

    def gpu_encoder(self, layer: int, st: L.StreamLayout):
        """The GPU OMP encoder of a coded stream (made on first use, freed with the arena)."""
        return self._writes.gpu_encoder(layer, st)

    def layer_words(self, layer: int) -> np.ndarray:
        """A copy of a layer buffer's raw words (uint32), for tests and the dump tool."""
        return self.memory.layer_words(layer)

    # --- appends and reads ------------------------------------------------------------------------
    def append(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, seq: int = 0) -> int:
        """Append new tokens' K/V head vectors, float32 (n_kv, T_new, head_dim) each, to
        sequence ``seq``. Coded streams are encoded on the CPU (codec.encode_heads: each KV
        head through its dictionary) or the GPU (``encoder``); only the new slots go to the
        device. Returns the sequence's new token count in the layer."""
        i, seq = self.memory.layer_index(layer), self.memory.seq_index(seq)
        return self._writes.append(i, self._writes.new_rows(i, k_rows, v_rows, seq), seq)

    def append_codes(self, layer: int, k: np.ndarray, v: np.ndarray, seq: int = 0, rows=None) -> int:
        """Append already-encoded tokens to sequence ``seq``: uint32 slots (n_kv, T_new,
        slot_words) for a coded stream (codec.encode_heads' output), float32 rows (n_kv,
        T_new, head_dim) for a passthrough stream (stored as f16 in an f16 cache). Slots are
        stored as given (an out-of-range atom index reconstructs as zero). A layer with an
        exact window (kvdict_vk.window) also takes ``rows``: the tokens' (K, V) float32 rows,
        whose sink and recent ones it keeps in binary16."""
        i, seq = self.memory.layer_index(layer), self.memory.seq_index(seq)
        w = self._writes
        if w.kivi:  # float32 rows: a KIVI cache quantises them itself
            return self.append(i, k, v)
        words = []
        for n, a, st in zip(("k", "v"), (k, v), self.layout.layers[i].streams):
            if st.coded:
                words.append(w.rows(n, a, np.uint32, st.row_words))
            else:
                words.append(R.row_words_of(w.rows(n, a, np.float32, self.layout.head_dim), st))
        w.check_room(i, words[0].shape[1], words[1].shape[1], seq)
        if self.layout.layers[i].windowed:
            if rows is None:
                raise E.ArenaError(f"layer {i}: a dictionary cache with an exact window keeps its tokens' binary16 "
                                   f"rows beside their slots: give append_codes the float32 rows too (rows=(K, V))")
            rows = w.new_rows(i, *rows, seq)
            if rows[0].shape[1] != words[0].shape[1]:
                raise E.ShapeError(f"append_codes: {words[0].shape[1]} tokens' codes, {rows[0].shape[1]} tokens' rows")
        elif rows is not None:
            raise E.ArenaError(f"layer {i}: rows are for a windowed layer's window; this layer keeps none")
        return w.append_words(i, *words, seq=seq, rows=rows)

    def read(self, layer: int, t0: int = 0, t1: int | None = None, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) float32 (n_kv, t1 − t0, head_dim) for tokens [t0, t1) of sequence ``seq``,
        reconstructed on the GPU."""
        return reader.read(self.memory, layer, t0, t1, seq)

    def read_plan(self, layer: int, t0: int = 0, t1: int | None = None, seq: int = 0) -> ReadPlan:
        """A recorded, re-runnable read of [t0, t1) of sequence ``seq`` (benchmarks:
        dispatch() and readback() separately). The range must fit one read-back buffer."""
        return ReadPlan(self.memory, *reader.row_range(self.memory, layer, t0, t1, seq))

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float | None = None) -> np.ndarray:
        """Decode attention of one new query token over the layer's first ``n_used`` cached
        tokens: q (n_heads, head_dim) float32 with n_heads a multiple of n_kv_heads (query
        head h reads KV head h // (n_heads / n_kv_heads)); softmax(scale · q·k), scale
        defaulting to 1/sqrt(head_dim). Returns (n_heads, head_dim) float32. The same call
        in both cache modes: over f32 rows, or straight over the codes (K and V are never
        materialised) — see kvdict_vk.vk.attend.engine."""
        i = self.memory.layer_index(layer)
        self._one_sequence("attend")
        q, n_used, scale = check_query(self.layout, q, n_used, self.memory.n_tokens(i), scale)
        return self.attention(q.shape[0]).attend(i, q, n_used, scale)

    def attend_batch(self, layer: int, q: np.ndarray, n_used, scale: float | None = None) -> np.ndarray:
        """Batched decode attention: q (B, n_heads, head_dim) float32, sequence b's query
        heads over its first n_used[b] cached tokens (1 ≤ n_used[b] ≤ its token count), for
        sequences 0 .. B − 1 of a batched arena (B ≤ seqs) — every sequence in the same
        dispatches (the flash kernels; the dictionaries' reads shared), as ``attend`` per
        sequence otherwise. Returns (B, n_heads, head_dim) float32."""
        i = self.memory.layer_index(layer)
        if not isinstance(q, np.ndarray) or q.ndim != 3 or not 1 <= q.shape[0] <= self.seqs:
            raise E.ShapeError(f"attend_batch: q must be (B, n_heads, head_dim) with 1 ≤ B ≤ {self.seqs}, got "
                               f"{getattr(q, 'shape', type(q).__name__)}")
        used = np.asarray(n_used)
        if used.shape != (q.shape[0],) or used.dtype.kind not in "iu":
            raise E.ArenaError(f"attend_batch: n_used must be {q.shape[0]} integers, got {n_used!r}")
        for b in range(q.shape[0]):
            check_query(self.layout, q[b], int(used[b]), self.memory.n_tokens(i, b), scale)
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
        i = self.memory.layer_index(layer)
        for what, a in (("k_rows", k_rows), ("v_rows", v_rows)):
            if not isinstance(a, np.ndarray) or a.ndim != 4 or not 1 <= a.shape[0] <= self.seqs:
                raise E.ShapeError(f"step_batch: {what} must be (B, n_kv, T_new, head_dim) with 1 ≤ B ≤ "
                                   f"{self.seqs}, got {getattr(a, 'shape', type(a).__name__)}")
        if k_rows.shape[0] != v_rows.shape[0] or not isinstance(q, np.ndarray) or q.ndim != 3 \
                or q.shape[0] != k_rows.shape[0]:
            raise E.ShapeError(f"step_batch: K, V and q must hold the same sequences, got {k_rows.shape[0]}, "
                               f"{v_rows.shape[0]} and {getattr(q, 'shape', None)}")
        batch = k_rows.shape[0]
        rows = [self._writes.new_rows(i, k_rows[b], v_rows[b], b) for b in range(batch)]
        n_new = rows[0][0].shape[1]
        n_used = [self.memory.n_tokens(i, b) + n_new for b in range(batch)]
        for b in range(batch):  # q, scale and each sequence's tokens checked before anything is written
            check_query(self.layout, q[b], n_used[b], n_used[b], scale)
        self._writes.append_batch(i, rows)
        return self.attention(q.shape[1]).attend_batch(i, q, n_used, check_scale(scale, self.layout.head_dim))

    def _one_sequence(self, what: str) -> None:
        if self.seqs > 1:
            raise E.ArenaError(f"{what} serves an arena of one sequence; this one holds {self.seqs}: "
                               f"append(seq=…) and attend_batch")

    def step(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray,
             scale: float | None = None) -> np.ndarray:
        """One decode step: append the new tokens' K/V (as ``append``), then attend with q
        over every token of the layer, the new ones included (as ``attend`` with n_used =
        the new token count) — in ONE submission: the scatter into the layer and the
        attention passes, which read the new tokens from the upload buffer (kvdict_vk.vk.attend.engine
        says why). Returns (n_heads, head_dim) float32. Same call in both cache modes."""
        i = self.memory.layer_index(layer)
        self._one_sequence("step")
        w = self._writes
        rows = w.new_rows(i, k_rows, v_rows)
        t0, t_new = self.memory.n_tokens(i), rows[0].shape[1]
        q, n_used, scale = check_query(self.layout, q, max(t0 + t_new, 1), t0 + t_new, scale)
        att = self.attention(q.shape[0])
        if w.kivi or self.layout.layers[i].windowed:  # append, then attend: two submissions
            w.append(i, rows)
            return att.attend(i, q, n_used, scale)
        if w.gpu_encodes(i, rows):
            w.append_gpu(i, rows)  # the slots are made on the device: two submissions
            return att.attend(i, q, n_used, scale)
        words = w.encode(i, rows, t0)  # after every check: OMP is the expensive part
        staged = None if t_new == 0 or t_new > att.max_fresh_tokens(i) else w.stage_step(i, *words)
        if staged is None:
            w.append_words(i, *words)  # a prefill: two submissions
            return att.attend(i, q, n_used, scale)
        out = att.step(i, q, t0, t_new, scale, *staged)
        self.memory.advance(i, 0, t_new)
        return out

    def record_step(self, n_heads: int, layers=None, batch: int = 1, scale: float | None = None,
                    n_plan: int | None = None, timestamps: bool = False, record: bool = True) -> DecodeStep:
        """A decode step of ``layers`` (default: every layer) recorded once, for ``n_heads``
        query heads and sequences 0 .. batch − 1: ``step.run(k_rows, v_rows, q)`` appends one
        token per sequence to each layer and attends over it, replaying the same commands with
        the step's values in buffers (kvdict_vk.vk.arena.decode says how). The flash kernels
        attend (f16 / f32 / q8_0 rows, both streams dict-coded, or KIVI for one sequence), their
        launch shape planned at ``n_plan`` tokens (default: the capacity). The step is freed
        with the arena, or by its own free(). ``record`` False: its ops only, for a device
        forward to record among its own (kvdict_vk.vk.forward.DeviceForward), the rows made
        on the device (a dict-coded stream's coded there by the GPU encoder)."""
        att = self.attention(n_heads)
        idx = list(range(self.layout.n_layers)) if layers is None else [self.memory.layer_index(i) for i in layers]
        step = DecodeStep(self.memory, self._writes, att, idx, batch, check_scale(scale, self.layout.head_dim),
                          n_plan, timestamps, record)
        self._steps = [s for s in self._steps if not s.closed] + [step]
        return step

    def attention(self, n_heads: int) -> Attention:
        """The attention engine for ``n_heads`` query heads (benchmarks use it directly)."""
        self.memory.check_live()
        if n_heads not in self._attention:
            self._attention[n_heads] = Attention(self.memory, n_heads)
        return self._attention[n_heads]

    def free(self) -> None:
        """Release every device resource. Idempotent; any later use raises ArenaError."""
        if self.memory.closed:
            return
        for step in self._steps:  # before the engines: their pipelines bind its buffers
            step.free()
        self._steps.clear()
        for att in self._attention.values():
            att.free()
        self._attention.clear()
        self._writes.free()
        self.memory.free()

    def __enter__(self) -> "KvArena":
        self.memory.check_live()
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.closed else f"{self.layout.total_bytes} bytes"
        return (f"KvArena({self.mode}, layers={self.layout.n_layers}, n_kv={self.layout.n_kv_heads}, "
                f"head_dim={self.layout.head_dim}, n_ctx={self.layout.n_ctx}, {state}, {self.device.name})")
