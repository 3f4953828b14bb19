"""A decode step recorded once and replayed per token (KvArena.record_step).

KvArena.step builds a layer's operations in Python on every call and submits each layer on
its own: host work that, on a GPU, costs several times the step's GPU time. A DecodeStep
records append + attention of every layer it covers (each with one new token per
sequence of a batch) into ONE command buffer, once; each :meth:`DecodeStep.run` writes the
step's values and replays it:

* the per-step values live in buffers the host writes, none in push constants: each layer's
  query block holds its query heads and, per sequence, n_used (the new token's position + 1:
  attend_common.glsl's SEQ_USED word) — append_step writes the new K/V words at the row it
  names, and the flash kernels attend over that many tokens in splits whose length follows
  it (push split_len 0: SPLIT_LEN);
* the new K/V rows of every layer sit in one buffer (every layer's K rows —
  sequence, KV head —, then every layer's V rows) as float32, which append_step turns into
  the cache's binary16 or q8_0 words on the device (bit for bit NumPy's: rows_encode.glsl),
  or as a dict-coded stream's slots; every layer's query block in one
  device buffer (the kernels' q_word): both go up in one copy, and every layer's merge
  writes its output into one buffer (attend_merge_head's out_word) that comes back in one
  copy: a replay is a few NumPy writes, one submission and one read.

The recording runs the flash kernels only (attend_flash over f16 / f32 / q8_0 rows — or its
cooperative-matrix sibling where Attention.flash_kernel asks for it — and attend_flash_coded
over a dict-coded layer); their launch shape is planned once, at the length ``n_plan``
(default: the sequence's capacity), so a replay at a shorter context runs the same
workgroups with shorter splits. A dict-coded layer's new tokens are coded on the host
(codec.encode_heads), as KvArena.append's CPU path codes them — or, in a step a device forward
records (``record`` False, one sequence: its rows are made on the device), by the GPU encoder's
one-dispatch form from float rows in the step buffer into a buffer of slots that append_step
copies from (GpuEncoder.recorded_op; its ties may differ from the host's). A KIVI layer's (one
sequence) go into its exact windows on the device, which also quantises a group as it
leaves them (append_kivi.comp: the host's words, bit for bit); the arena's host state of
the layer then says the window's rows are on the device (kivi_store).

The query blocks and the output are the DecodeStep's own buffers; the split records are the
arena's attention engine's (a barrier between layers), so a DecodeStep and that engine's
attend calls take turns, as every use of one arena does.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ... import codec
from ... import errors as E
from ... import layout as L
from ... import rows as R
from ..device import kp
from ..attend.ops import PassBuilder, Placement
from ..attend.specs import lengths_word, query_words
from ..abi import WG_SIZE
from ..kernels import Buffer, barrier, pipeline, run
from ..submit import Recording


class DecodeStep:
    """The decode step of ``layers`` of an arena (its memory and write paths), for ``batch``
    sequences (0 .. batch − 1) with ``attention``'s query heads, recorded once. ``scale``:
    the softmax scale (None: 1/sqrt(head_dim)); ``n_plan``: the length the flash launch shape
    is planned at (None: the sequences' capacity); ``timestamps``: GPU time of each run
    (:meth:`gpu_seconds`) where the device has them. ``record`` False: no recording of its
    own — a device forward (kvdict_vk.vk.forward) records :attr:`layer_ops` between its own
    ops, its projections writing the rows and queries straight into the step's buffers."""

    def __init__(self, memory, writes, attention, layers, batch: int, scale: float, n_plan: int | None = None,
                 timestamps: bool = False, record: bool = True):
        lay = memory.layout
        self.memory, self.layout, self.device = memory, lay, memory.device
        self.layers, self.batch, self.scale = tuple(layers), int(batch), float(scale)
        self._layer_rows = np.array(self.layers)  # the layers as an index into the token counts
        self.n_heads, hd, n_kv = attention.n_heads, lay.head_dim, lay.n_kv_heads
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise E.ArenaError(f"record_step: layers must be distinct, at least one, got {layers!r}")
        if not 1 <= self.batch <= memory.seqs:
            raise E.ArenaError(f"record_step: a batch of {batch} sequences; this arena holds {memory.seqs}")
        n_plan = memory.seq_ctx if n_plan is None else int(n_plan)
        if not 1 <= n_plan <= memory.seq_ctx:
            raise E.ArenaError(f"record_step: n_plan {n_plan} outside 1..{memory.seq_ctx}")
        for i in self.layers:
            k, v = lay.layers[i].streams
            if k.coded != v.coded:
                raise E.ArenaError(f"layer {i}: a recorded step attends by the flash kernels, which need both "
                                   f"streams dict-coded or neither")
        # plans first (they may time launch shapes on the device): nothing is allocated on a refusal
        # (a KIVI layer timed with the window a decode at n_plan holds: ArenaWrites.kivi_state_at)
        with (writes.kivi_state_at(self.layers, n_plan) if attention.times_plans else contextlib.nullcontext()):
            plans = [attention.flash_plan(i, n_plan, self.batch) for i in self.layers]
        self.plans = tuple(plans)  # each layer's flash launch shape (profiles print them)
        self._writes = writes
        self._streams = [lay.layers[i].streams for i in self.layers]
        self._kivi_layers = np.array([i for i in self.layers if lay.layers[i].k.kivi], np.intp)
        # a device forward's rows are made on the device: its coded streams are coded there too
        self._device_coded = not record and any(k.coded or v.coded for k, v in self._streams)
        if self._device_coded and self.batch != 1:
            raise E.ArenaError(f"a device forward's dict-coded step serves one sequence, not {self.batch}")
        # no coded stream: the step's rows go into the step buffer as they come, in one write each
        self._rows_only = not any(k.coded or v.coded for k, v in self._streams)
        # the step buffer: every layer's K source rows (batch, n_kv, row), then every layer's V rows
        k_n = [self.batch * n_kv * _source_words(k, hd) for k, _ in self._streams]
        v_n = [self.batch * n_kv * _source_words(v, hd) for _, v in self._streams]
        self._k_src = np.cumsum([0] + k_n).tolist()
        self._v_src = (self._k_src[-1] + np.cumsum([0] + v_n)).tolist()
        # device-coded streams: their float rows after the sources, each area on a quad (their
        # slots, at the sources' words, in a buffer of their own: a kernel's written buffer is
        # bound once)
        # a windowed layer's streams (kvdict_vk.window): their float rows too, for append_window
        # a device-coded K stream coded before RoPE: its rows unturned too, which the encoder codes
        # (the forward's projection writes both: k_pre_word)
        self._rows_at, self._pre_at, end = {}, {}, -(-self._v_src[-1] // 4) * 4
        for j, streams in enumerate(self._streams):
            for st in streams:
                if (self._device_coded and st.coded) or st.windowed:
                    self._rows_at[(j, st.stream)] = end
                    end += -(-n_kv * hd // 4) * 4
                if self._device_coded and st.key_rope is not None:
                    self._pre_at[j] = end
                    end += -(-n_kv * hd // 4) * 4
        # a q8_0 or KIVI layer appended by the forward's projection (row_append): an arrival word a
        # (stream, KV head, pair of blocks) or a KV head, zero between dispatches — one set for every layer
        fused = {self._fused_format(j) for j in range(len(self._streams))}
        self._arrival_at = end if fused & set(R.QKV_THROUGH_ROWS) else 0
        end += R.qkv_arrival_words(n_kv, hd) if self._arrival_at else 0
        self._q_words = query_words(self.batch, self.n_heads, hd)
        self._q_stride = -(-self._q_words // 4) * 4  # each layer's block starts on a quad
        self._lengths_at = lengths_word(self.batch, self.n_heads, hd)
        self._out_words = self.batch * self.n_heads * hd  # a multiple of 4: head_dim is
        n_l = len(self.layers)
        self._q = self._out = self._step = self._slots = self._rec = None
        self._encoders = []
        try:
            # device-local (append_step reads each source float of a q8_0 block 32 times), up in
            # the same copy as the queries
            self._step = Buffer(self.device, end, "device", "decode step K/V rows")
            if self._arrival_at:  # the arrival words zero on the device before the first dispatch
                run(self.device, kp.OpTensorSyncDevice([self._step.tensor]), what="zeroing the arrival words")
            if self._device_coded:
                self._slots = Buffer(self.device, self._v_src[-1], "storage", "decode step slots")
            self._q = Buffer(self.device, n_l * self._q_stride, "device", "decode step queries")
            self._out = Buffer(self.device, n_l * self._out_words, "device", "decode step output")
            self.append_ops, self.attend_ops = self._layer_ops(attention, plans)
            if record:
                core = [op for ops in self.layer_ops for op in ops]
                self._rec = Recording(self.device, [kp.OpTensorSyncDevice([self._step.tensor, self._q.tensor]),
                                                    *core, kp.OpTensorSyncLocal([self._out.tensor])],
                                      timestamps=timestamps and "spans",
                                      what=f"decode step over {len(self.layers)} layers", core=(1, 1 + len(core)))
        except BaseException:
            self.free()
            raise
        # views of the host-visible words, made once (a replay writes and reads only these)
        words = self._step.host_words()
        self._k_host, self._v_host = words[:self._k_src[-1]], words[self._k_src[-1]:self._v_src[-1]]
        self._step_host = words
        blocks = self._q.host_words().reshape(n_l, self._q_stride)
        self._q_host, self._used_host = blocks[:, :self._lengths_at], blocks[:, self._lengths_at:self._q_words]
        self._out_host = self._out.host_words()
        # run()'s arrays as views of the step's own buffers (inputs(), replay())
        self._q_in = _float_view(self._q_host, (n_l, self.batch, self.n_heads, hd))
        self._out_view = _float_view(self._out_host, (n_l, self.batch, self.n_heads, hd))
        self._rows_in = ((_float_view(self._k_host, (n_l, self.batch, n_kv, hd)),
                          _float_view(self._v_host, (n_l, self.batch, n_kv, hd))) if self._rows_only else None)

    @property
    def layer_ops(self) -> list:
        """Per layer, its append ops then its attention ops."""
        return [a + b for a, b in zip(self.append_ops, self.attend_ops)]

    def _layer_ops(self, attention, plans) -> tuple[list, list]:
        """Per layer, its append ops — append_step, a barrier on the layer — and apart (a kernel
        before them may append instead: row_append) its attention ops — its flash passes (the
        merge's output at the layer's place in the one output buffer), a barrier on the
        engine's scratch (the next layer's passes reuse it). The recording puts the copy of
        the K/V rows and query blocks up before them all and the outputs' copy back after."""
        lay, mem, n_kv = self.layout, self.memory, self.layout.n_kv_heads
        appends, attends = [], []
        passes = PassBuilder(mem, attention.buffers.with_io(self._q, self._out), attention.shapes, attention.grid)
        for j, (i, plan) in enumerate(zip(self.layers, plans)):
            k, v = self._streams[j]
            layer_buf, q_word = mem.layer_buffer(i), self.q_word(j)
            encode = [self._encode_op(i, j, st) for st in (k, v) if self._device_coded and st.coded]
            if encode:  # the rows' slots into the slots buffer's source area, for append_step
                encode.append(barrier(self._slots))
            if k.kivi:  # into the windows; a group leaving them quantised (a workgroup a sequence's KV head)
                append = pipeline(self.device, "append_kivi", [self._step, self._q, layer_buf],
                                  dict(HEAD_DIM=lay.head_dim, K_BITS=k.kivi_bits, V_BITS=v.kivi_bits),
                                  max_items=self.batch * n_kv * WG_SIZE)
                op = append.op(k_src_word=self._k_src[j], v_src_word=self._v_src[j], k_word=k.region_word,
                               v_word=v.region_word, stats_word=k.stats_word, k_window_word=k.window_word,
                               v_window_word=v.window_word, recent=lay.kivi.recent,
                               state_word=k.state_word, n_kv=n_kv, n_ctx=lay.n_ctx,
                               lengths_word=q_word + self._lengths_at, n_seqs=self.batch, seq_rows=mem.seq_ctx)
            else:
                units = sum(_append_units(st, lay.head_dim, self.batch * n_kv) for st in (k, v))
                src = self._slots if encode else self._step
                append = pipeline(self.device, "append_step", [src, self._q, layer_buf],
                                  max_items=units * WG_SIZE)
                op = append.op(k_src_word=self._k_src[j], v_src_word=self._v_src[j], k_word=k.region_word,
                               v_word=v.region_word, k_row_words=k.row_words, v_row_words=v.row_words, n_kv=n_kv,
                               n_seqs=self.batch, n_ctx=lay.n_ctx, seq_rows=mem.seq_ctx,
                               lengths_word=q_word + self._lengths_at,
                               k_format=R.APPEND_FORMATS[R.append_format(k)],
                               v_format=R.APPEND_FORMATS[R.append_format(v)], head_dim=lay.head_dim)
            append = [*encode, op, barrier(layer_buf)]
            if k.windowed:  # the token's binary16 rows into the windows, and the state word
                append += [self._window_op(i, j), barrier(layer_buf)]
            attend = passes.flash_ops(i, plan, mem.seq_ctx, self.scale,
                                      Placement(q_word=q_word, out_word=self.out_word(j), dynamic=True))
            attend.append(attention.barrier_op())
            appends.append(append)
            attends.append(attend)
        return appends, attends

    def _fused_format(self, j: int) -> str | None:
        """The QKV_FORMATS key of layer j's streams where a projection can append the token
        itself (row_append), else None."""
        k, v = self._streams[j]
        if self.batch != 1 or any(st.coded or st.windowed for st in (k, v)):
            return None
        if k.kivi or v.kivi:  # fwd_qkv's KIVI heads are KV heads: an arena of one sequence
            return "kivi" if (k.kivi and v.kivi and self.layout.head_dim <= R.QKV_KIVI_MAX_HEAD_DIM
                              and k.kivi_seqs == 1) else None
        fmt = R.append_format(k)
        return fmt if fmt in ("f16", "words", "q8_0") and R.append_format(v) == fmt else None

    def row_append(self, j: int) -> dict | None:
        """What a kernel that appends layer j's (of ``layers``) token itself, in place of
        :attr:`append_ops`, needs (fwd_qkv's push): the rows' words and their format
        (rows.QKV_FORMATS: binary16 pairs, f32 rows' words as they are, q8_0 blocks, a KIVI layer's
        rings and groups — those two through the source rows and the step buffer's arrival
        words), the K and V regions (row (g, t) at region + (g · n_ctx + t) · row_words), a KIVI
        layer's statistics, rings and state word; or None, where the append is more than the
        token's rows (coded slots, an exact window) or the step holds a batch of sequences. Its
        specialization: :meth:`row_append_spec`."""
        fmt = self._fused_format(j)
        if fmt is None:
            return None
        k, v = self._streams[j]
        out = dict(row_words=k.row_words, row_format=R.QKV_FORMATS[fmt], k_layer_word=k.region_word,
                   v_layer_word=v.region_word, arrival_word=self._arrival_at if fmt in R.QKV_THROUGH_ROWS else 0)
        if fmt == "kivi":
            out.update(stats_word=k.stats_word, k_window_word=k.window_word, v_window_word=v.window_word,
                       recent=self.layout.kivi.recent, state_word=k.state_word)
        return out

    def row_append_spec(self, j: int) -> dict:
        """The specialization constants the appending kernel's row_append(j) needs: a KIVI
        layer's head_dim and bits (kivi_append.glsl), else none."""
        k, v = self._streams[j]
        if self._fused_format(j) != "kivi":
            return {}
        return dict(HEAD_DIM=self.layout.head_dim, K_BITS=k.kivi_bits, V_BITS=v.kivi_bits)

    def _window_op(self, i: int, j: int):
        """append_window of layer i (j-th of the step): the token's rows from their float rows."""
        k, v = self._streams[j]
        win, n_kv, hd = k.exact_window, self.layout.n_kv_heads, self.layout.head_dim
        kernel = pipeline(self.device, "append_window", [self._step, self._q, self.memory.layer_buffer(i)],
                          max_items=2 * n_kv * hd // 2)
        return kernel.op(k_rows_word=self._rows_at[(j, "k")], v_rows_word=self._rows_at[(j, "v")],
                         k_window_word=k.window_word, v_window_word=v.window_word, rows=win.rows, sink=win.sink,
                         recent=win.recent, state_word=k.state_word, n_kv=n_kv, head_dim=hd,
                         lengths_word=self.q_word(j) + self._lengths_at)

    def _encode_op(self, i: int, j: int, st):
        """The GPU encoder's op coding layer i's (j-th of the step) stream ``st`` from its float
        rows into its slots. An encoder of the step's own (one-dispatch form), not the arena's
        (kvdict_vk.vk.arena.writes.gpu_encoder): an encoder keeps a few pipelines per destination
        and releases the oldest, which a live recording must not lose."""
        from ..encode.encoder import GpuEncoder
        enc = GpuEncoder(self.device, self._writes.stream_dict(i, st.stream), max_batch=self.layout.n_kv_heads,
                         kernel="tiled")
        self._encoders.append(enc)
        src = self._k_src[j] if st.stream == "k" else self._v_src[j]
        rows = self._pre_at[j] if st.key_rope is not None else self._rows_at[(j, st.stream)]
        return enc.recorded_op(self._step, rows, self._slots, src, self.layout.n_kv_heads)

    # --- where a device forward writes and reads (layer j of ``layers``) ---------------------------
    @property
    def buffers(self) -> tuple:
        """(rows, queries, output): the K/V source rows, the query blocks (each layer's queries,
        then its sequences' n_used words), every layer's attention output."""
        return self._step, self._q, self._out

    def q_word(self, j: int) -> int:
        return j * self._q_stride

    def k_rows_word(self, j: int) -> int:
        """Where layer j's new K rows go as float32 (batch, n_kv, head_dim)."""
        return self._rows_at.get((j, "k"), self._k_src[j])

    def k_pre_word(self, j: int) -> int:
        """Where layer j's new K rows go unturned as well (a device-coded K stream coded before
        RoPE, whose slots the step's encoder makes from them; 0: none)."""
        return self._pre_at.get(j, 0)

    def v_rows_word(self, j: int) -> int:
        return self._rows_at.get((j, "v"), self._v_src[j])

    def out_word(self, j: int) -> int:
        return j * self._out_words

    def lengths_word(self, j: int) -> int:
        """Where layer j's query block holds its sequences' n_used words."""
        return j * self._q_stride + self._lengths_at

    @property
    def query_stride(self) -> int:
        """Words from one layer's query block to the next."""
        return self._q_stride

    def stage_lengths(self) -> np.ndarray:
        """Check that every sequence of every layer has room for one more token and write
        each one's n_used (its count + 1) into the query blocks' host copy; returns them
        (n_layers, batch). A full sequence is an ArenaError, before anything is written."""
        self.memory.check_live()
        if self._q is None:
            raise E.ArenaError("the decode step was freed")
        used = self.memory.counts(self._layer_rows, self.batch) + 1
        if used.max() > self.memory.seq_ctx:
            j, s = np.unravel_index(int(used.argmax()), used.shape)
            raise E.ArenaError(f"layer {self.layers[j]}: sequence {s} is full ({self.memory.seq_ctx} tokens)")
        self._used_host[:] = used
        return used

    def advance(self) -> None:
        """Count the token a replay appended to every sequence of every layer (a KIVI layer's
        host state: its window's rows are on the device)."""
        if self._kivi_layers.size:
            self._writes.kivi_appended_on_device(self._kivi_layers, self.batch)
        self.memory.advance_each(self._layer_rows, self.batch)

    # --- a step -------------------------------------------------------------------------------
    def run(self, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """One decode step: k_rows / v_rows float32 (n_layers, batch, n_kv, head_dim) — each
        sequence's new token in each of the step's layers (in ``layers`` order) — appended,
        then q (n_layers, batch, n_heads, head_dim) float32 attending over every token of its
        sequence, the new one included. Returns (n_layers, batch, n_heads, head_dim) float32.
        Everything is checked before anything is written; a full sequence is an ArenaError."""
        self._check_replayable()
        lay, n_l, b = self.layout, len(self.layers), self.batch
        hd, n_kv = lay.head_dim, lay.n_kv_heads
        for what, a, heads in (("k_rows", k_rows, n_kv), ("v_rows", v_rows, n_kv), ("q", q, self.n_heads)):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (n_l, b, heads, hd):
                raise E.ShapeError(f"DecodeStep.run: {what} must be float32 {(n_l, b, heads, hd)}, got "
                                   f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
        used = self.stage_lengths()
        if self._rows_only:
            self._rows_in[0][:] = k_rows
            self._rows_in[1][:] = v_rows
        else:
            k_words, v_words = self._sources(k_rows, v_rows, used)  # a dict-coded layer's OMP: before any write
            self._k_host[:] = k_words
            self._v_host[:] = v_words
            for (j, stream), at in self._rows_at.items():  # a windowed layer's float rows (batch 1)
                rows = (k_rows if stream == "k" else v_rows)[j].reshape(-1).view(np.uint32)
                self._step_host[at:at + rows.size] = rows
        self._q_in[:] = q
        self._rec.run()
        self.advance()
        return self._out_view.copy()

    def inputs(self) -> tuple:
        """(k_rows, v_rows, q): float32 views of the step's own buffers, shaped as :meth:`run`
        takes them. Write a token's values into them (a matmul's ``out=``) and call
        :meth:`replay`: nothing is copied on the way. Valid until :meth:`free`. An uncoded
        cache's step only (a dict-coded layer's rows are coded on the host, by run)."""
        self._check_replayable()
        if self._rows_in is None:
            raise E.ArenaError("a dict-coded layer's rows are coded on the host: give them to run()")
        return (*self._rows_in, self._q_in)

    def replay(self) -> np.ndarray:
        """One decode step over what :meth:`inputs` holds (as run does with its arrays).
        Returns a float32 view (n_layers, batch, n_heads, head_dim) of the step's output
        buffer: valid until the next replay or run, and until free. A full sequence is an
        ArenaError, before anything is submitted."""
        self._check_replayable()
        if self._rows_in is None:
            raise E.ArenaError("a dict-coded layer's rows are coded on the host: give them to run()")
        self.stage_lengths()
        self._rec.run()
        self.advance()
        return self._out_view

    def _check_replayable(self) -> None:
        self.memory.check_live()
        if self._rec is None:
            raise E.ArenaError("the decode step was freed" if self._q is None else
                               "a decode step recorded inside a device forward has no run of its own")

    def _sources(self, k_rows: np.ndarray, v_rows: np.ndarray, used: np.ndarray) -> tuple:
        """The step buffer's words where a layer is dict-coded: every layer's K sources then
        every layer's V sources, each flat (layer, batch, n_kv, …): an uncoded stream's
        float32 rows (append_step converts them), a coded stream's slots (codec.encode_heads,
        every sequence's token in one batch; keys coded before RoPE turned back from each
        sequence's position, its used − 1)."""
        out = ([], [])
        for j, i in enumerate(self.layers):
            # (batch, n_kv, hd) → (n_kv, batch, hd): a head's tokens through its dictionary, each
            # sequence's token at its position used − 1
            heads = self._writes.coding_rows(i, (k_rows[j].transpose(1, 0, 2), v_rows[j].transpose(1, 0, 2)),
                                             used[j].astype(np.int64) - 1)
            for rows, coding, st, dst in zip((k_rows[j], v_rows[j]), heads, self._streams[j], out):
                if st.coded:
                    slots = codec.encode_heads(coding, self._writes.stream_dict(i, st.stream))
                    dst.append(slots.transpose(1, 0, 2))
                else:
                    dst.append(rows.view(np.uint32))
        return tuple(np.concatenate([w.reshape(-1) for w in words]) for words in out)

    # --- timing and lifetime -------------------------------------------------------------------
    def gpu_seconds(self) -> float | None:
        """GPU time of the last run's appends and attentions (None: no timestamps asked for,
        or none on this device)."""
        return None if self._rec is None else self._rec.core_seconds()

    def submitted_gpu_seconds(self) -> float | None:
        """GPU time of all the last run submitted: gpu_seconds and the copies of the queries
        up and the output back."""
        return None if self._rec is None else self._rec.gpu_seconds()

    def free(self) -> None:
        """Release the recording and the step's buffers (and the pipelines that bind them).
        Idempotent; the arena frees its steps when it is freed."""
        if self._rec is not None:
            self._rec.free()
            self._rec = None
        for enc in self._encoders:
            enc.free()
        self._encoders = []
        for buf in (self._q, self._out, self._step, self._slots):
            if buf is not None:
                buf.destroy()
        self._q = self._out = self._step = self._slots = None

    @property
    def closed(self) -> bool:
        return self._rec is None

    def __enter__(self) -> "DecodeStep":
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def _append_units(st, head_dim: int, rows: int) -> int:
    """append_step's units (its workgroups' share) of a stream's ``rows`` rows: a pair of
    q8_0 blocks each, or WG_SIZE words."""
    if R.append_format(st) == "q8_0":
        return rows * L.q8_scale_words(head_dim)  # a pair of blocks shares a scale word
    return -(-rows * st.row_words // WG_SIZE)


def _source_words(st, head_dim: int) -> int:
    """Words of a stream's source row in the step buffer: its slot (coded), else head_dim floats."""
    return st.row_words if st.coded else head_dim


def _float_view(words: np.ndarray, shape: tuple) -> np.ndarray:
    """words as float32 of ``shape`` — a view (reshape would copy silently where it cannot)."""
    out = words.view(np.float32).reshape(shape)
    if not np.shares_memory(out, words):
        raise E.ArenaError(f"decode step: no {shape} view of its buffer")  # a layout bug, never input
    return out
