"""What an append to a KIVI cache (kvdict_vk.kivi) writes, and where — on the host, before
anything reaches the device, so a refused or failed append changes nothing the cache shows.

A KIVI layer holds its newest tokens exact (binary16, the window ring) until their group is
``recent`` tokens old, then quantises the whole group: a key group's per-channel statistics
need all of its tokens. The host keeps the rows of the tokens not yet quantised (at most
``window`` per KV head), so the groups that leave the window are quantised from them — from
their binary16 values, as kvdict_vk.kivi quantises — exactly what kvdict_vk.kivi.cache_rows
computes. After a recorded decode step appended on the device (append_kivi.comp, which
quantises the same way) those rows are the device's window: the next host append reads them
back from it (``read_window``).

An append's writes come in an order that keeps every token already visible readable at
every point in between: the rows (and key statistics) of the groups it quantises, then the
layer's state word (the quantised end the read shader consults), then the new tokens' window
rows — those only overwrite ring slots of tokens the state word already sends to their
quantised rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import kivi as K
from ... import layout as L
from ..kernels import Write


SLICE = 2048  # tokens quantised per NumPy pass (the level packing's temporaries grow with it)


@dataclass(frozen=True)
class LayerState:
    """A KIVI layer's host state for one sequence: the quantised end and the float32 rows of
    tokens [q_end, n_tokens) — (K, V), each (n_kv, n_tokens − q_end, head_dim)."""
    q_end: int
    pending: tuple


class KiviStore:
    """The host side of a KvArena's KIVI layers (one per arena)."""

    def __init__(self, layout: L.ArenaLayout, read_window=None):
        """``read_window(layer, seq, t0, t1)``: the (K, V) window rows of tokens [t0, t1) of a
        sequence from the device, float32 (n_kv, t1 − t0, head_dim) each."""
        self.layout, self.spec, self._read_window = layout, layout.kivi, read_window
        hd, n_kv = layout.head_dim, layout.n_kv_heads
        empty = np.zeros((n_kv, 0, hd), np.float32)
        seqs = layout.layers[0].k.kivi_seqs
        self._state = {(ll.index, s): LayerState(0, (empty, empty)) for ll in layout.layers for s in range(seqs)}
        # [layer, sequence]: a recorded step appended to it since the host last did
        self._on_device = np.zeros((len(layout.layers), seqs), bool)

    def plan(self, layer: int, seq: int, n_tokens: int, k_rows: np.ndarray,
             v_rows: np.ndarray) -> tuple[list, LayerState]:
        """The writes of appending (K, V) rows (n_kv, T, head_dim) to sequence ``seq`` of
        ``layer`` holding n_tokens, in their order, and its state after them (commit it once
        written)."""
        lay, spec = self.layout, self.spec
        ll = lay.layers[layer]
        k_st, v_st = ll.streams
        old = self._state[layer, seq]
        if self._on_device[layer, seq]:  # the device moved the quantised end; the window holds the rest
            q_end = K.quantised_end(n_tokens, spec.recent)
            old = LayerState(q_end, self._read_window(layer, seq, q_end, n_tokens))
        n_new = n_tokens + k_rows.shape[1]
        q_new = K.quantised_end(n_new, spec.recent)
        pending = [np.concatenate([p, r], axis=1) for p, r in zip(old.pending, (k_rows, v_rows))]
        writes = []
        if q_new > old.q_end:  # whole groups leave the window: quantise them
            n_q = q_new - old.q_end
            k_part, v_part = (p[:, :n_q] for p in pending)
            keys = [K.quantise_keys(k_part[:, t:t + SLICE], spec.k_bits) for t in range(0, n_q, SLICE)]
            v_words = np.concatenate([K.quantise_values(v_part[:, t:t + SLICE], spec.v_bits)
                                      for t in range(0, n_q, SLICE)], axis=1)
            at = k_st.kivi_stats_word  # the groups from q_end on, a KV head after another
            writes.append(Write(at(0, seq, old.q_end), np.concatenate([st for st, _ in keys], axis=1),
                                at(1, seq, old.q_end) - at(0, seq, old.q_end)))
            row0 = seq * k_st.seq_ctx + old.q_end
            writes.append(Write(k_st.region_word + row0 * k_st.row_words,
                                np.concatenate([lv for _, lv in keys], axis=1), lay.n_ctx * k_st.row_words))
            writes.append(Write(v_st.region_word + row0 * v_st.row_words, v_words, lay.n_ctx * v_st.row_words))
            writes.append(Write(k_st.state_word + seq, np.full((1, 1, 1), q_new, np.uint32), 1))
            pending = [p[:, n_q:] for p in pending]
        # the new tokens still exact after this append, into the ring (at most two runs: it wraps)
        first = max(n_tokens, q_new)
        for st, rows in zip(ll.streams, (k_rows, v_rows)):
            # binary16 pairs, element 2k in the low half (the f16 cache's rows)
            half = np.ascontiguousarray(rows[:, first - n_tokens:], np.float32).astype(np.float16).view(np.uint32)
            writes += _ring_writes(st, seq, first, half)
        return writes, LayerState(q_new, tuple(pending))

    def commit(self, layer: int, seq: int, state: LayerState) -> None:
        self._state[layer, seq] = state
        self._on_device[layer, seq] = False

    def appended_on_device(self, layers, batch: int = 1) -> None:
        """A recorded step appended tokens to sequences 0 .. batch − 1 of ``layers`` on the
        device: their quantised ends moved as kivi.quantised_end says, their rows not yet
        quantised are the device window's (the next host append reads them back)."""
        self._on_device[layers, :batch] = True  # a replay's: no loop over layers and sequences


def _ring_writes(st: L.StreamLayout, seq: int, t0: int, words: np.ndarray) -> list:
    """Window rows of tokens t0.. of sequence ``seq`` (words (n_kv, T, head_dim / 2)) at their
    ring slots."""
    w, at = st.window_tokens, st.kivi_ring_word
    out, done = [], 0
    while done < words.shape[1]:
        t = t0 + done
        run = min(words.shape[1] - done, w - t % w)
        out.append(Write(at(0, seq, t), words[:, done:done + run], at(1, seq, t) - at(0, seq, t)))
        done += run
    return out
