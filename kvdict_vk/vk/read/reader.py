"""One recorded read of one layer of a KvArena: the reconstruct (coded streams) or
copy_rows (passthrough streams) dispatches into a read-back buffer, then the copy back.
Plans work on the arena's memory (kvdict_vk.vk.arena.memory.ArenaMemory); ``read`` is
KvArena.read (a range of any length, a plan per read-back buffer's worth).

Recorded once and re-runnable, so a benchmark can time ``dispatch()`` (GPU work only)
and ``readback()`` separately; ``KvArena.read`` uses ``run()`` (one submission). The
read-back buffer is a "device" buffer of the smallest size class that fits: Kompute's
OpTensorSyncLocal copies the whole buffer, with the barriers that make the shader's
writes visible to the host.

(Successor of ``read_plan.py``: the same plan, for slots with a residual stage and
per-head dictionaries.)
"""
from __future__ import annotations

import numpy as np

from ... import errors as E
from ... import kivi as K
from ..device import kp
from ..kernels import Buffer, Kernel, barrier, pipeline
from ..submit import Recording
from . import mapping as M


def row_range(memory, layer, t0, t1, seq=0) -> tuple[int, int, int]:
    """(layer index, first row, end row) of tokens [t0, t1) of sequence ``seq`` (t1 None:
    every token appended): rows of a KV head's slice (sequence s starts at row s · seq_ctx)."""
    i, seq = memory.layer_index(layer), memory.seq_index(seq)
    n = memory.n_tokens(i, seq)
    t1 = n if t1 is None else t1
    for name, t in (("t0", t0), ("t1", t1)):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise E.ArenaError(f"{name} must be an integer, got {t!r}")
    if not 0 <= t0 <= t1:
        raise E.ArenaError(f"token range [{t0}, {t1}) is empty-inverted or negative")
    if t1 > memory.seq_ctx:
        raise E.ArenaError(f"token range [{t0}, {t1}) exceeds n_ctx {memory.seq_ctx}")
    if t1 > n:
        raise E.ArenaError(f"token range [{t0}, {t1}) exceeds the {n} tokens appended to layer {i}")
    base = seq * memory.seq_ctx
    return i, base + int(t0), base + int(t1)


def read(memory, layer, t0=0, t1=None, seq=0) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) float32 (n_kv, t1 − t0, head_dim) for tokens [t0, t1) of sequence ``seq``,
    reconstructed on the GPU, a read-back buffer's worth at a time."""
    i, t0, t1 = row_range(memory, layer, t0, t1, seq)
    n_kv, hd = memory.layout.n_kv_heads, memory.layout.head_dim
    k = np.empty((n_kv, t1 - t0, hd), np.float32)
    v = np.empty_like(k)
    step = memory.read_tokens
    for c0 in range(t0, t1, step):
        c1 = min(t1, c0 + step)
        k[:, c0 - t0:c1 - t0], v[:, c0 - t0:c1 - t0] = ReadPlan(memory, i, c0, c1).run_once()  # rows of the heads' slices
    return k, v


class ReadPlan:
    """One read of one layer, recorded once: ``dispatch()`` (the GPU work only),
    ``readback()`` (copy to the host), ``run()`` (both, one submission). Read-back buffers
    are shared by the arena's reads: call readback() right after this plan's dispatch()."""

    def __init__(self, arena, layer: int, t0: int, t1: int, out: Buffer | None = None):
        """``arena``: the arena's memory (an ArenaMemory); ``layer``, rows [t0, t1) of its
        KV heads' slices, checked. ``out``: write into this buffer instead of a read-back
        buffer (the attention's reconstruct-then-attend path); then only ``dispatch()`` is
        meaningful."""
        lay = arena.layout
        n_kv, hd, n_tok = lay.n_kv_heads, lay.head_dim, t1 - t0
        self.n_words = 2 * n_kv * n_tok * hd
        if out is None and self.n_words > arena.read_words:
            raise E.ArenaError(f"[{t0}, {t1}) needs {self.n_words} words, a read-back buffer holds "
                               f"{arena.read_words}; use read()")
        self.shape = (n_kv, n_tok, hd)
        if out is None:
            out = arena.readback_buffer(self.n_words)
        self.out, self.arena = out, arena
        self.ops = []
        layer_buf = arena.layer_buffer(layer)
        for j, st in enumerate(lay.layers[layer].streams):
            common = dict(src_word=st.region_word, n_ctx=lay.n_ctx, t0=t0, n_tok=max(n_tok, 1),
                          n_rows=n_kv * n_tok, out_word=j * n_kv * n_tok * hd)
            if st.coded:
                kern = self._kernel("reconstruct", [layer_buf, layer_buf, out, layer_buf], SPARSITY=st.sparsity,
                                    RES_BITS=st.residual_bits, ATOMS_F16=int(st.atoms_f16))
                self.ops.append(kern.op(atoms_word=st.atoms_word, mean_word=st.mean_word, n_atoms=lay.n_atoms,
                                        scale_word=st.scale_word, head_atoms=st.head_atoms_stride,
                                        head_vec=st.head_vec_stride, **common))
            elif st.kivi:
                kern = self._kernel("read_rows_kivi", [layer_buf, out], BITS=st.kivi_bits,
                                    KEYS=int(st.stream == "k"), GROUP=K.GROUP)
                self.ops.append(kern.op(stats_word=st.stats_word or 0, window_word=st.window_word,
                                        window=st.window_tokens, state_word=st.state_word, seq_ctx=st.seq_ctx,
                                        **common))
            elif st.half or st.q8:
                shader = "read_rows_f16" if st.half else "read_rows_q8"
                kern = self._kernel(shader, [layer_buf, out])
                self.ops.append(kern.op(**common))
            else:
                kern = self._kernel("copy_rows", [layer_buf, out])
                self.ops.append(kern.op(**common))
        k = lay.layers[layer].k
        if k.key_rope is not None and n_tok:  # the slots decode keys at position 0: turn them to theirs
            self.ops.append(barrier(out))
            kern = pipeline(arena.device, "rope_rows", [layer_buf, out], {"HEAD_DIM": hd},
                            max_items=n_kv * n_tok * hd // 4)
            self.ops.append(kern.op(table_word=k.rope_word, hi_rows=k.rope_hi_rows,  # positions within the sequence
                                    shift=k.rope_shift, t0=t0 % arena.seq_ctx, n_tok=n_tok,
                                    n_rows=n_kv * n_tok, out_word=0))
        windowed = [(j, st) for j, st in enumerate(lay.layers[layer].streams) if st.windowed]
        if windowed and n_tok:  # the window's rows over the slots' reconstruction
            self.ops.append(barrier(out))
            for j, st in windowed:
                win = st.exact_window
                kern = pipeline(arena.device, "read_window", [layer_buf, out], {"HEAD_DIM": hd},
                                max_items=n_kv * win.rows * hd // 2)
                self.ops.append(kern.op(window_word=st.window_word, rows=win.rows, sink=win.sink,
                                        recent=win.recent, state_word=st.state_word, n_kv=n_kv, t0=t0,
                                        n_tok=n_tok, out_word=j * n_kv * n_tok * hd))
        self._recordings: dict = {}

    def _kernel(self, shader: str, buffers, **spec) -> Kernel:
        a = self.arena
        a.check_live()
        if shader in ("read_rows_f16", "read_rows_q8", "read_rows_kivi"):  # an invocation per 2 / 4 elements
            per = 2 if shader == "read_rows_f16" else 4
            return pipeline(a.device, shader, buffers, {"HEAD_DIM": a.layout.head_dim, **spec},
                          max_items=buffers[-1].words // per)
        variant = f"{shader}_{'vec4' if M.vec4_rows(a) else 'scalar'}"
        if shader == "reconstruct":
            chunks, pipelined = M.reconstruct_mapping(a, spec["SPARSITY"], bool(spec["ATOMS_F16"]))
            mapping = {"CHUNKS": chunks, "PIPELINED": int(pipelined)}
        else:
            mapping = {"CHUNKS": M.row_chunks(a)}
        return pipeline(a.device, variant, buffers, {"HEAD_DIM": a.layout.head_dim, **mapping, **spec},
                      max_items=buffers[-1].words // a.layout.head_dim)

    def recording(self, part: str = "run", timestamps: bool | str = False) -> Recording:
        """The recorded sequence of ``part``: "dispatch" (the GPU work only), "readback"
        (the copy to the host) or "run" (both); made on first use and kept."""
        key = (part, "ops" if timestamps == "ops" else bool(timestamps))  # True is "spans"
        if key not in self._recordings:
            sync = kp.OpTensorSyncLocal([self.out.tensor])
            ops = {"dispatch": self.ops, "readback": [sync], "run": [*self.ops, sync]}[part]
            self._recordings[key] = Recording(self.arena.device, ops, timestamps=timestamps,
                                              what=f"read ({part})")
        return self._recordings[key]

    def _run(self, part: str) -> None:
        self.arena.check_live()
        self.recording(part).run()

    def dispatch(self) -> None:
        self._run("dispatch")

    def readback(self) -> tuple[np.ndarray, np.ndarray]:
        self._run("readback")
        return self._split()

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        self._run("run")
        return self._split()

    def run_once(self) -> tuple[np.ndarray, np.ndarray]:
        """run() without keeping a recording (KvArena.read: each read is a new range)."""
        self.arena.check_live()
        self.arena.device.submit(*self.ops, kp.OpTensorSyncLocal([self.out.tensor]), what="reading")
        return self._split()

    def _split(self) -> tuple[np.ndarray, np.ndarray]:
        half = self.n_words // 2
        words = self.out.host_words()[:self.n_words].view(np.float32)
        return words[:half].reshape(self.shape).copy(), words[half:].reshape(self.shape).copy()
