"""The attention wing's buffers (kvdict_vk.vk.attend.engine owns them; kvdict_vk.vk.attend.ops
binds them): the query block, the output, the split records and the coded paths' scratch,
sized by attend_specs.Sizes; the reconstruct-then-attend rows and the L2 flush scratch made on
first use. Everything is kept until free().
"""
from __future__ import annotations

import copy

import numpy as np

from ..device import kp
from ..kernels import Buffer, barrier, pipeline
from .specs import Sizes, lengths_word


class AttendBuffers:
    """The buffers of one engine: ``sizes`` (attend_specs.Sizes) for ``n_heads`` query heads;
    the q·atom table where a layer's K is dict-coded (``k_coded``), the atom weights and their
    products where a V is (``v_coded``), the scores where either is. ``None`` for those it
    does not need."""

    def __init__(self, device, sizes: Sizes, n_heads: int, k_coded: bool, v_coded: bool):
        self.device, self.sizes, self.n_heads = device, sizes, n_heads
        self.owned: list[Buffer] = []  # what barrier_op covers and free() destroys
        self.recon: Buffer | None = None  # reconstructed K/V rows (reconstructed())
        self.flush_scratch: dict = {}  # words read → (kernel, source, sink): flush_ops' L2 flushes
        self.bins_clear = False  # whether the atom weights are zero (clear_bins)
        self.table = self.scores = self.bins = self.blocks = None
        try:
            sz, new = sizes, self._new
            # device-local: on a discrete GPU a shader reading host-visible memory crosses
            # PCIe on every load; the query is copied up once per call instead (q_upload)
            self.q = new(sz.query, "device", "attention query")
            self.out = new(sz.out, "device", "attention output")
            self.stats = new(sz.stats, "device", "attention split stats")
            self.accs = new(sz.accs, "device", "attention split accumulators")
            self.dummy = new(4, "storage", "unused binding")
            self.table = new(sz.table, "device", "q·atom table") if k_coded else None
            self.scores = new(sz.scores, "storage", "attention scores") if k_coded or v_coded else None
            self.bins = new(sz.bins, "device", "split atom weights") if v_coded else None
            self.blocks = new(sz.blocks, "device", "atom-weight products") if v_coded else None
            self.clear_bins()
        except BaseException:
            self.free()
            raise

    def _new(self, words: int, kind: str, name: str) -> Buffer:
        b = Buffer(self.device, words, kind, name)
        self.owned.append(b)
        return b

    def with_io(self, q: Buffer, out: Buffer) -> "AttendBuffers":
        """A view of these buffers with other query and output buffers (a recorded decode
        step's, every layer's block in each: kvdict_vk.vk.arena.decode) and this engine's
        scratch. It owns nothing: the caller frees q and out, the engine the rest."""
        view = copy.copy(self)
        view.q, view.out, view.owned, view.flush_scratch = q, out, [], {}
        return view

    def clear_bins(self) -> None:
        """The split pass expects zero atom weights (attend_atoms.comp leaves them so after a
        completed attention): on creation, and after an attention that did not complete."""
        if self.bins is None or self.bins_clear:
            return
        self.bins.host_words()[:] = 0
        self.device.submit(kp.OpTensorSyncDevice([self.bins.tensor]), what="clearing the atom weights")
        self.bins_clear = True

    def reconstructed(self, words: int) -> Buffer:
        """The f32 rows reconstruct-then-attend writes (``words`` of them), made on first use."""
        if self.recon is None:
            self.recon = self._new(words, "storage", "reconstructed K/V")
        return self.recon

    # --- the query block and the output --------------------------------------------------------
    def upload_query(self, q: np.ndarray, n_used) -> None:
        """The query block's host words: q (seqs × n_heads × head_dim floats), then each
        sequence's n_used (``n_used``: an int, or one per sequence; attend_common.glsl)."""
        words = np.ascontiguousarray(q, np.float32).reshape(-1).view(np.uint32)
        self.q.host_words()[:words.size] = words
        self.upload_lengths([n_used] if np.ndim(n_used) == 0 else n_used)

    def upload_lengths(self, lengths) -> None:
        """Each sequence's n_used into the query block's host words (the flash kernels read them)."""
        at = lengths_word(len(lengths), self.n_heads, self.sizes.head_dim)
        self.q.host_words()[at:at + len(lengths)] = np.asarray(lengths, np.uint32)

    def output(self, seqs: int = 0) -> np.ndarray:
        """The output's host words as (n_heads, head_dim) float32 — or, ``seqs`` > 0,
        (seqs, n_heads, head_dim)."""
        shape = (max(seqs, 1), self.n_heads, self.sizes.head_dim)
        words = self.out.host_words()[:int(np.prod(shape))]
        out = words.view(np.float32).reshape(shape).copy()
        return out if seqs else out[0]

    # --- the L2 flush ahead of timed passes ------------------------------------------------------
    def flush_ops(self, n_bytes: int) -> list:
        """An L2 flush to record ahead of timed passes (none for n_bytes 0): l2_flush reads
        n_bytes of a scratch buffer and writes nothing back, then a barrier, so the passes
        start on a busy GPU with whatever it pushed out of the L2 gone and no dirty lines left
        to write back (a copy leaves its destination's). Buffers are made once per size and
        kept until freed: recordings hold on to their ops."""
        words = n_bytes // 4 // 4 * 4  # whole vec4s
        if words <= 0:
            return []
        if words not in self.flush_scratch:
            src = Buffer(self.device, words, "storage", "L2 flush source")
            sink = Buffer(self.device, 4, "storage", "L2 flush sink")
            flush = pipeline(self.device, "l2_flush", [src, sink], max_items=words // 4)
            self.flush_scratch[words] = (flush, src, sink)
        flush, _, sink = self.flush_scratch[words]
        return [flush.op(n_words=words), barrier(sink)]

    def free_flush(self) -> None:
        flushes, self.flush_scratch = self.flush_scratch, {}
        for _, src, sink in flushes.values():  # and with them the flush's pipeline
            sink.destroy()
            src.destroy()

    def free(self) -> None:
        self.free_flush()
        for b in self.owned:
            b.destroy()
        self.owned.clear()
