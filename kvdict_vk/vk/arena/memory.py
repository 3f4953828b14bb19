"""The device memory of one KvArena, and what its wings (the write paths, the reads, the
attention engine) are given to work on: the device, the layout, one storage buffer per
layer, the host-visible upload buffer, the shared read-back buffers, the limits all of them
were sized against, and the token count of every (layer, sequence). Pipelines are the
device's (kernels.pipeline), freed with the buffers they bind.

Sizing happens before anything is allocated (ArenaTooLargeError on a device that cannot
hold the arena); everything is freed with ``free()``, after which every use raises
ArenaError.
"""
from __future__ import annotations

import numpy as np

from ... import errors as E
from ... import layout as L
from ..device import Device, kp
from ..kernels import Buffer, pipeline, run
from . import config as C


class ArenaMemory:
    """The buffers, pipelines and token counts of one arena (laid out by ``layout``)."""

    def __init__(self, layout: L.ArenaLayout, device: Device, shader_mapping: str | None, seqs: int, seq_ctx: int):
        """``shader_mapping``: "row" (one invocation per row: CPU drivers), "chunk" (one per
        output chunk: GPUs) or None (by device type). ``seqs`` sequences of ``seq_ctx``
        tokens each (layout.n_ctx = seqs · seq_ctx rows per KV head)."""
        self.layout, self.device = layout, device
        self._seqs, self._seq_ctx = int(seqs), int(seq_ctx)
        # CPU drivers: one invocation per row (code words read once per row); GPUs: one per
        # output chunk (coalesced stores, code words broadcast by the cache).
        if shader_mapping is None:
            shader_mapping = "row" if device.is_cpu else "chunk"
        if shader_mapping not in ("row", "chunk"):
            raise E.ArenaError(f"shader_mapping must be 'row', 'chunk' or None, got {shader_mapping!r}")
        self.shader_mapping = shader_mapping
        self._caps = self._check_limits()  # ArenaTooLargeError before anything is allocated
        self._layers: list[Buffer] = []
        self._outs: dict[int, Buffer] = {}
        self._upload = None
        self._n_tokens = np.zeros((layout.n_layers, self._seqs), np.int64)  # [layer, sequence]
        self._freed = False
        try:
            self._upload = Buffer(device, self._caps["upload"], "host", "upload buffer")
            for ll in layout.layers:
                self._layers.append(Buffer(device, ll.total_words, "storage", f"layer {ll.index} buffer"))
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
        out_cap = min(C.OUT_CAP_WORDS, max_buf // 4, max(C.OUT_MIN_WORDS, token_out * lay.n_ctx))
        out_cap -= out_cap % token_out
        # big enough for a full context or the tail/guard image of a layer, within the cap
        init = max((ll.total_words if ll.guard_spans else ll.tail_words) for ll in lay.layers)
        upload = min(C.UPLOAD_CAP_WORDS, max_buf // 4, max(token_up * lay.n_ctx, init))
        upload = max(upload - upload % token_up, token_up)
        if out_cap < token_out or upload * 4 > max_buf:
            raise E.ArenaTooLargeError(f"{name}: one token does not fit a {max_buf}-byte buffer")
        # read-back buffers are "device" tensors: device memory plus a staging copy
        total = lay.total_bytes + 4 * upload + 2 * 4 * out_cap * C.OUT_CLASS_STEP // (C.OUT_CLASS_STEP - 1)
        heap = self.device.info.device_local_bytes
        if total > heap:
            raise E.ArenaTooLargeError(f"{name}: the arena needs {total} bytes, the device heap has {heap}")
        return {"upload": upload, "out": out_cap, "token_out": token_out, "token_up": token_up}

    def _out_class(self, words: int) -> int:
        size = C.OUT_MIN_WORDS
        while size < words:
            size *= C.OUT_CLASS_STEP
        return min(size, self._caps["out"])

    # --- buffers and pipelines --------------------------------------------------------------------
    def layer_buffer(self, layer: int) -> Buffer:
        """The storage buffer of ``layer`` (laid out by self.layout)."""
        return self._layers[self.layer_index(layer)]

    @property
    def upload_buffer(self) -> Buffer:
        """The host-visible buffer appends and decode steps stage their words in."""
        self.check_live()
        return self._upload

    @property
    def upload_words(self) -> int:
        """Words the upload buffer holds."""
        return self._caps["upload"]

    @property
    def token_upload_words(self) -> int:
        """Upload words one token of every KV head takes, in the widest layer (K and V)."""
        return self._caps["token_up"]

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

    def layer_words(self, layer: int, word: int = 0, n_words: int | None = None) -> np.ndarray:
        """A copy of a layer buffer's raw words (uint32) — all of them, or ``n_words`` from
        ``word`` — for tests, the dump tool and a KIVI window read back."""
        i = self.layer_index(layer)
        src = self._layers[i]
        n = src.words - word if n_words is None else n_words
        if not (0 <= word and 0 < n and word + n <= src.words):
            raise E.ArenaError(f"layer_words: words [{word}, {word + n}) outside the layer's {src.words}")
        dst = Buffer(self.device, n, "device", f"layer {i} read-back")
        try:
            copy = pipeline(self.device, "copy_scalar", [src, dst], max_items=n)
            run(self.device, copy.op(src_word=word, dst_word=0, n_words=n),
                kp.OpTensorSyncLocal([dst.tensor]), what=f"reading layer {i} back")
            return np.array(dst.host_words(), np.uint32)
        finally:
            dst.destroy()  # and the copy's pipeline with it

    # --- sequences and token counts ---------------------------------------------------------------
    @property
    def seqs(self) -> int:
        """Sequences the arena holds (1 unless made batched)."""
        return self._seqs

    @property
    def seq_ctx(self) -> int:
        """Tokens a sequence holds at most (the n_ctx it was made with)."""
        return self._seq_ctx

    def n_tokens(self, layer: int, seq: int = 0) -> int:
        """Tokens appended to sequence ``seq`` of ``layer``."""
        return int(self._n_tokens[self.layer_index(layer), self.seq_index(seq)])

    def advance(self, layer: int, seq: int, n_new: int) -> int:
        """Count ``n_new`` more tokens written to sequence ``seq`` of ``layer`` (indices
        already checked); returns the new count."""
        self._n_tokens[layer, seq] += n_new
        return int(self._n_tokens[layer, seq])

    def counts(self, layers, batch: int) -> np.ndarray:
        """Token counts (len(layers), batch) of ``layers`` (distinct indices, already checked),
        sequences 0 .. batch − 1: a copy (a recorded step reads them once a step)."""
        return self._n_tokens[layers, :batch]

    def advance_each(self, layers, batch: int) -> None:
        """One more token written to sequences 0 .. batch − 1 of each of ``layers`` (distinct)."""
        self._n_tokens[layers, :batch] += 1

    def row0(self, layer: int, seq: int) -> int:
        """The layer row (within a KV head's slice) of the sequence's next token."""
        return seq * self._seq_ctx + int(self._n_tokens[layer, seq])

    # --- checks -----------------------------------------------------------------------------------
    def check_live(self) -> None:
        """ArenaError once the arena was freed (the arena's own methods and its operations check it)."""
        if self._freed:
            raise E.ArenaError("the arena was freed")

    @property
    def closed(self) -> bool:
        return self._freed

    def layer_index(self, layer) -> int:
        """``layer`` checked (a live arena, an integer within the layout) as an int."""
        self.check_live()
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise E.LayerIndexError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.layout.n_layers:
            raise E.LayerIndexError(f"layer {layer} outside 0..{self.layout.n_layers - 1}")
        return int(layer)

    def seq_index(self, seq) -> int:
        """``seq`` checked (an integer below seqs) as an int."""
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < self._seqs:
            raise E.ArenaError(f"seq must be an integer in 0..{self._seqs - 1}, got {seq!r}")
        return int(seq)

    def free(self) -> None:
        """Destroy every buffer (and so every pipeline that binds one). Idempotent; any later
        use raises ArenaError."""
        self._freed = True
        for b in [*self._outs.values(), *self._layers, self._upload]:
            if b is not None:
                b.destroy()
        self._outs.clear()
        self._layers = []
        self._upload = None
