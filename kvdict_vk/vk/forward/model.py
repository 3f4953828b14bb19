"""A llama model's decode on the device: every layer's forward around the arena's recorded
decode step, one submission a token (issue 52, item 2).

A :class:`DeviceForward` holds the weights resident (weights.py's formats: GGUF's own Q4_1 and
Q8_0 blocks, dequantised in the kernels) and records, once, the whole token: the token's
embedding row into the residual; per layer, Q, K and V in one dispatch over the normed
residual, RoPE'd as they are written straight into the decode step's query block and source
rows — over f16, f32 or q8_0 rows and KIVI layers, the keys and values into the layer at the
token's position instead (q8_0: a pair of blocks by the workgroup whose rows complete it; KIVI:
a KV head's rings and group by the one completing the head), so the step records no append for
it (fwd_qkv; DecodeStep.row_append) → the step's append and attention
(kvdict_vk.vk.arena.decode, record=False) → the O projection added to the residual → gate and
up over the normed residual → the down projection of their SwiGLU added to the residual
(fwd_matvec; matvec.glsl reads the norm and the SwiGLU into the matvec, so neither has a
dispatch of its own); then the LM head over the final norm and a two-stage argmax, the greedy
next token written into the state buffer. A replay is a host write of the step's values — the
token, its position and each layer's n_used, in a host-visible buffer the kernels read (a
scatter puts the n_used words into the query blocks) —, one submission, and a read of the next
token (and, where asked, the logits): no copy up, so every device buffer is written by kernels
only.

Buffers: the weights (as few as the device's limits allow, each holding whole layers; "device"
buffers, so a host copy stays beside them); the RoPE table (host-made,
kvdict_vk.model_file.rope_cos_sin's numbers); ``values`` (the step's, host-visible); ``state``
(the next token, the residual stream); ``act`` (gate and up; the logits); the argmax's partials.
"""
from __future__ import annotations

import numpy as np

from ... import errors as E
from ... import rows as R
from ...model_file import rope_cos_sin
from ...rope import KeyRope
from ..device import kp
from ..kernels import Buffer, barrier, pipeline, run
from ..abi import WG_SIZE
from ..submit import Recording
from .specs import MAX_SEQ_TILE, X_MODES  # importing specs registers the fwd_* variants' dispatch arithmetic
from .weights import FORMATS, Matrix, ModelWeights, dequantised, f32_matrix

# The step's values: each sequence's token, then each one's position, then each layer's n_used of
# each sequence (a batch of B: TOKEN_WORD + s, POS_WORD · B + s, USED_WORD · B + j · B + s).
TOKEN_WORD, POS_WORD, USED_WORD = 0, 1, 2
NEXT_WORD = 0  # the state buffer: each sequence's greedy next token, then (on a quad) the residual streams
ARGMAX_PARTS = 256  # fwd_argmax's first stage: workgroups over the vocabulary
MATVEC_ROW_THREADS = 32  # fwd_matvec's ROW_THREADS on a GPU (lab/probes/forward_profile.py)
MATVEC_WORKGROUPS = 1024  # the most workgroups a matvec dispatches (grid stride past them)
WEIGHT_BUFFER_BYTES = 1 << 30  # the most a weights buffer holds (whole layers), within the device's limits


class DeviceForward:
    """``weights``' decode over ``arena`` (its layers, KV heads and head_dim the model's; an
    uncoded cache — f32, f16 or q8_0 rows —, the KIVI cache, its groups quantised on the
    device as they leave the window, or the dictionary cache, its rows coded on the device by
    the GPU encoder), sequence 0, one token a :meth:`run`. ``logits``:
    read the logits back each run (:meth:`logits`); ``timestamps``: GPU time of each run
    (:meth:`gpu_seconds`); ``n_plan``: the length the attention's launch shape is planned at
    (default: the arena's capacity); ``row_threads``: fwd_matvec's invocations a row (a power of
    two ≤ 64; default: 1 on a CPU driver, MATVEC_ROW_THREADS on a GPU); ``subgroups``: whether
    a row's invocations add by subgroup shuffles (the _sg builds; None: where the device has
    them and a row fits in a subgroup; True where it cannot is a DispatchError);
    ``qkv_appends``: over a layer of f16, f32 or q8_0 rows or a KIVI layer, fwd_qkv appends the
    token's K and V into the layer itself and the step's append is not recorded
    (DecodeStep.row_append; False: the step's own append, as every other cache has); ``layers``:
    the model's layers [a, b) this forward runs, the arena holding just those (a device's part
    of a layer split: the first part embeds the token, a later one takes the residual stream
    from :meth:`run_part`'s caller, and only the last one has the LM head; default: every
    layer); ``heads``: the KV heads [h0, h1) this forward attends over, the arena holding just those (a device's part of a head
    split: Q, K and V of its heads only, and every layer's O projection over the attention
    output of every head, which the caller gathers between :meth:`run_segment` calls — see
    SplitForward; the rest of the layer, the norms, MLP and LM head, whole on every part;
    default: every KV head); ``batch``: sequences 0 .. batch − 1 of the arena decoded together, a
    token each a :meth:`run_batch` (their positions their own; every layer and KV head: no
    range of either), the weights read once for all of them (each matvec's workgroups read the
    same rows at once), the attention over every sequence in one dispatch
    (DecodeStep of a batch; the token's K and V appended by the step, not the projection);
    ``seq_tile``: sequences of the batch a matvec workgroup makes its rows for at once, each
    weight chunk decoded once for them (fwd_matvec's and fwd_qkv's SEQ_TILE, 1 .. MAX_SEQ_TILE;
    default 1: a workgroup a sequence). Freed by :meth:`free`."""

    def __init__(self, weights: ModelWeights, arena, *, logits: bool = False, timestamps: bool = False,
                 n_plan: int | None = None, row_threads: int | None = None, subgroups: bool | None = None,
                 qkv_appends: bool = True, layers: tuple[int, int] | None = None,
                 heads: tuple[int, int] | None = None, batch: int = 1, seq_tile: int = 1):
        cfg, lay = weights.config, arena.layout
        a, b = (0, cfg.n_layers) if layers is None else layers
        h0, h1 = (0, cfg.n_kv_heads) if heads is None else heads
        if not 0 <= a < b <= cfg.n_layers:
            raise E.ShapeError(f"layers [{a}, {b}) are not a range of the model's {cfg.n_layers}")
        if not 0 <= h0 < h1 <= cfg.n_kv_heads:
            raise E.ShapeError(f"KV heads [{h0}, {h1}) are not a range of the model's {cfg.n_kv_heads}")
        if (b - a) < cfg.n_layers and (h1 - h0) < cfg.n_kv_heads:
            raise E.ShapeError("a forward runs a range of layers or a range of KV heads, not both")
        if isinstance(batch, (bool, np.bool_)) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise E.ShapeError(f"batch must be a positive int, got {batch!r}")
        if batch > 1 and (layers is not None or heads is not None):
            raise E.ShapeError("a batch of sequences runs every layer and KV head, not a range of either")
        if isinstance(seq_tile, (bool, np.bool_)) or not isinstance(seq_tile, (int, np.integer)) \
                or not 1 <= seq_tile <= MAX_SEQ_TILE:
            raise E.ShapeError(f"seq_tile must be an int in 1..{MAX_SEQ_TILE}, got {seq_tile!r}")
        self.batch, self.seq_tile = int(batch), min(int(seq_tile), int(batch))
        if (lay.n_layers, lay.n_kv_heads, lay.head_dim) != (b - a, h1 - h0, cfg.head_dim):
            raise E.ShapeError(f"the arena holds {lay.n_layers} layers of {lay.n_kv_heads} KV heads × {lay.head_dim}; "
                               f"the forward runs {b - a} of {h1 - h0} × {cfg.head_dim}")
        self.layers, self.first, self.last = (a, b), a == 0, b == cfg.n_layers
        self.heads, self.split_heads = (h0, h1), (h1 - h0) < cfg.n_kv_heads
        self._n = b - a
        self._n_q = (cfg.n_heads // cfg.n_kv_heads) * (h1 - h0)  # the query heads this part attends for
        if cfg.hidden % 32 or cfg.ffn % 32 or (cfg.n_heads * cfg.head_dim) % 32:
            raise E.ShapeError("a device forward needs hidden, ffn and n_heads · head_dim multiples of 32")
        self.config, self.arena, self.device = cfg, arena, arena.device
        # invocations a matvec row: a CPU driver's SIMD lanes take a row each (no barrier); a GPU's
        # share one
        if row_threads is None:
            row_threads = 1 if self.device.is_cpu else MATVEC_ROW_THREADS
        if row_threads not in (1, 2, 4, 8, 16, 32, 64):
            raise E.ShapeError(f"row_threads must be a power of two up to 64, got {row_threads!r}")
        self._row_threads = row_threads
        fits = row_threads > 1 and self.device.shuffles_fit(row_threads, WG_SIZE)  # one lane adds nothing
        if subgroups and not fits:
            raise E.DispatchError(f"{self.device.name}: a matvec row's {row_threads} invocations cannot add by "
                                  f"subgroup shuffles (subgroup size {self.device.shuffle_subgroup_size() or 'none'} "
                                  f"with shuffles)")
        self.subgroups = fits if subgroups is None else bool(subgroups)
        if logits and not self.last:
            raise E.ArenaError("only the forward that runs the last layer has logits")
        self._want_logits = bool(logits)
        self._qkv_appends = bool(qkv_appends)
        self._buffers: list[Buffer] = []
        self._recs: list[Recording] = []
        # keys coded before RoPE: the step's encoder codes the projection's keys before this
        # model's RoPE, so the artifact's must be that one (built only where a layer needs it: a
        # model's RoPE need not be one KeyRope accepts otherwise)
        for i, ll in enumerate(lay.layers):
            if ll.k.key_rope is None:
                continue
            model_rope = KeyRope(cfg.rope_theta, cfg.rope_dim)
            if ll.k.key_rope != model_rope:
                raise E.DictMismatchError(f"layer {i}: the dictionary's keys were coded before RoPE {ll.k.key_rope}, "
                                          f"the model turns them by {model_rope}")
        self.step = arena.record_step(self._n_q, batch=self.batch, n_plan=n_plan, record=False)  # checks both
        try:
            self._load(weights)
            for i, seg in enumerate(self._segments()):
                self._recs.append(Recording(self.device, seg, timestamps=timestamps and "spans",
                                            what=f"device forward of layers {a}..{b - 1}, heads {h0}..{h1 - 1}, "
                                                 f"segment {i}", core=(0, len(seg) - 1)))
        except BaseException:
            self.free()
            raise
        self._state_host = self._state.host_words()
        self._values_host = self._values.host_words()
        self._act_host = self._act.host_words()
        self._out_host = self.step.buffers[2].host_words()
        self._gathered_host = self._gathered.host_words() if self.split_heads else None
        self._begun = False

    # --- buffers ---------------------------------------------------------------------------
    def _buffer(self, words, kind: str, name: str, init=None) -> Buffer:
        b = Buffer(self.device, words, kind, name, init)
        self._buffers.append(b)
        return b

    def _load(self, w: ModelWeights) -> None:
        """The weights into device buffers (one upload each), whole layers a buffer; the
        globals (embedding, output norm, LM head) in one more; the RoPE table; the scratch."""
        cfg, dev = self.config, self.device
        limit = min(dev.limit("max_storage_buffer_range"), dev.limit("max_memory_allocation_size") or 1 << 62,
                    WEIGHT_BUFFER_BYTES) // 4
        # per layer: its tensors' words, packed; where each starts
        packed, self._matrices = [], []
        hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        h0, h1 = self.heads
        for layer in w.layers[self.layers[0]:self.layers[1]]:
            mats = _layer_matrices(layer, (h0 * group * hd, h1 * group * hd), (h0 * hd, h1 * hd))
            parts = {"attn_norm": layer.attn_norm.view(np.uint32), "ffn_norm": layer.ffn_norm.view(np.uint32)}
            parts.update({name: m.words.reshape(-1) for name, m in mats.items()})
            self._matrices.append(mats)
            offsets, n = {}, 0
            for name, words in parts.items():
                offsets[name], n = n, n + -(-words.size // 4) * 4
            packed.append((parts, offsets, n))
        self._layer_buf, self._layer_base = [], []
        groups, start = [], 0
        for i, (_, _, n) in enumerate(packed):  # greedy: as many whole layers a buffer as fit
            if i > start and sum(p[2] for p in packed[start:i + 1]) > limit:
                groups.append((start, i))
                start = i
            if n > limit:
                raise E.ShapeError(f"layer {i}'s weights ({4 * n} bytes) exceed a buffer ({4 * limit} bytes)")
        groups.append((start, len(packed)))
        for g0, g1 in groups:
            total = sum(p[2] for p in packed[g0:g1])
            words, base = np.zeros(total, np.uint32), 0
            for parts, offsets, n in packed[g0:g1]:
                for name, part in parts.items():
                    words[base + offsets[name]:base + offsets[name] + part.size] = part
                self._layer_base.append((base, offsets))
                base += n
            buf = self._buffer(total, "device", f"weights of layers {g0}..{g1 - 1}", words)
            self._layer_buf += [buf] * (g1 - g0)
        self._tok, self._out_m = w.tok_embd, w.output
        # what this forward's ends read: the embedding (the first part), the output norm and the LM
        # head (the last; a tied head is the embedding, kept once where one part has both)
        glob = {}
        if self.first:
            glob["tok_embd"] = w.tok_embd.words.reshape(-1)
        if self.last:
            glob["output_norm"] = w.output_norm.view(np.uint32)
            if not (self.first and w.output is w.tok_embd):
                glob["output"] = w.output.words.reshape(-1)
        self._glob_at, n = {}, 0
        for name, g in glob.items():
            self._glob_at[name], n = n, n + -(-g.size // 4) * 4
        self._glob_at.setdefault("output", self._glob_at.get("tok_embd"))
        words = np.zeros(max(n, 4), np.uint32)
        for name, g in glob.items():
            words[self._glob_at[name]:self._glob_at[name] + g.size] = g
        self._glob = self._buffer(words.size, "device", "embedding, output norm, LM head", words)
        self._n_pos = self.step.memory.seq_ctx
        cos, sin = rope_cos_sin(np.arange(self._n_pos), cfg.rope_theta, cfg.rope_dim)
        self._table = self._buffer(cos.size * 2, "device", "RoPE table", np.concatenate([cos, sin], 1))
        B = self.batch
        self._x_word = -(-B // 4) * 4  # each sequence's residual stream, hidden words apart
        self._state = self._buffer(self._x_word + B * cfg.hidden, "device", "forward state")
        self._pos_word, self._used_word = POS_WORD * B, USED_WORD * B
        self._x_in_word = self._used_word + self._n * B  # a later part's residual stream, from the host
        self._values = self._buffer(self._x_in_word + (0 if self.first else cfg.hidden), "host",
                                    "forward step values")
        self._partial = self._buffer(2 * ARGMAX_PARTS * B, "device", "argmax partials")
        # each sequence's gate and up (2 · ffn words apart) or, at the end, its logits (vocab apart)
        self._act = self._buffer(B * max(2 * cfg.ffn, cfg.vocab), "device", "forward activations")
        if self.split_heads:  # every head's attention output, gathered by the caller, a layer at a time
            self._gathered = self._buffer(cfg.n_heads * cfg.head_dim, "host", "gathered attention output")
        run(self.device, kp.OpTensorSyncDevice([b.tensor for b in self._buffers if b.kind == "device"]),
            what="uploading the weights")

    # --- the recording ---------------------------------------------------------------------
    def _matvec(self, wbuf: Buffer, w_word: int, m: Matrix, x: Buffer, x_word: int, y: Buffer, y_word: int,
                accumulate: bool = False, x_mode: str = "plain", norm_word: int = 0, seq_words: tuple = (0, 0)):
        """fwd_matvec: y[y_word + r] (+)= row r of m · x' (x' as matvec.glsl's ``x_mode`` reads x),
        for each sequence of the batch (``seq_words``: its x and y that many words after the one
        before)."""
        n_rows, threads = m.n_rows, self._row_threads
        spec = {"FORMAT": FORMATS[m.fmt], "ROW_THREADS": threads, "X_MODE": X_MODES[x_mode],
                "SEQ_TILE": self.seq_tile}
        k = pipeline(self.device, self._shader("fwd_matvec"), [wbuf, x, y], spec, max_items=self._matvec_items(n_rows),
                     rows=-(-self.batch // self.seq_tile))
        return k.op(w_word=w_word, x_word=x_word, y_word=y_word, n_rows=n_rows, n_cols=m.n_cols,
                    accumulate=int(accumulate), norm_word=norm_word, n_seqs=self.batch, x_seq_words=seq_words[0],
                    y_seq_words=seq_words[1], eps=self.config.rms_eps)

    def _shader(self, name: str) -> str:
        return f"{name}_sg" if self.subgroups else name

    def _matvec_items(self, n_rows: int) -> int:
        """Invocations of a matvec: a row's ROW_THREADS each, at most MATVEC_WORKGROUPS workgroups
        (the rest by grid stride: a normed x's sum of squares once a workgroup, not once a row)."""
        rows_a_group = WG_SIZE // self._row_threads
        return min(-(-n_rows // rows_a_group), MATVEC_WORKGROUPS) * WG_SIZE

    def _argmax(self, n: int) -> list:
        """Each sequence's greedy token of its logits (act's words [s · n, (s + 1) · n)) into the
        state's NEXT_WORD + s."""
        parts, B = min(ARGMAX_PARTS, -(-n // 64)), self.batch
        stage0 = pipeline(self.device, "fwd_argmax", [self._act, self._partial, self._state], max_items=parts * 64,
                          rows=B)
        stage1 = pipeline(self.device, "fwd_argmax", [self._act, self._partial, self._state], rows=B)
        push = dict(x_word=0, n=n, out_word=NEXT_WORD, parts=parts, n_seqs=B)
        return [stage0.op(**push, stage=0), barrier(self._partial), stage1.op(**push, stage=1)]

    def _segments(self) -> list:
        """The token's ops, each section labelled (:attr:`op_labels`: a profile's key); over a
        range of KV heads cut after each layer's attention, whose output goes back to the host
        there (the next part starts with the O projection of every head's output)."""
        sections = self._sections()
        self.op_labels = [label for label, ops in sections for _ in ops]  # per op of the core, what it is part of
        attn_out = self.step.buffers[2]
        segments, ops = [], []
        for label, section in sections:
            ops += section
            if self.split_heads and label == "append + attention":
                segments.append(ops + [kp.OpTensorSyncLocal([attn_out.tensor])])
                ops = []
        back = [self._state.tensor] + ([self._act.tensor] if self._want_logits else [])
        return segments + [ops + [kp.OpTensorSyncLocal(back)]]

    def _sections(self) -> list:
        """The token's ops, a labelled section at a time."""
        cfg, step, B = self.config, self.step, self.batch
        rows, queries, attn_out = step.buffers
        st, act, X = self._state, self._act, self._x_word
        # a sequence's words in the residual streams, the MLP's activations and the attention output
        hid, mlp, out = cfg.hidden, 2 * cfg.ffn, self._n_q * cfg.head_dim
        used = pipeline(self.device, "scatter", [self._values, queries], max_items=self._n * B)
        sections = [("step values", [used.op(src_word=self._used_word, dst_word=step.lengths_word(0), row_words=B,
                                             group_rows=1, group_stride=step.query_stride, n_words=self._n * B)])]
        if self.first:
            embed = pipeline(self.device, "fwd_embed", [self._glob, self._values, st],
                             {"FORMAT": FORMATS[self._tok.fmt]}, max_items=cfg.hidden // 8, rows=B)
            sections.append(("embedding", [embed.op(w_word=self._glob_at["tok_embd"], token_word=TOKEN_WORD,
                                                    y_word=X, n_rows=self._tok.n_rows, n_cols=self._tok.n_cols,
                                                    n_seqs=B),
                                           barrier(st, queries)]))
        else:
            x_in = pipeline(self.device, "scatter", [self._values, st], max_items=cfg.hidden)
            sections.append(("residual in", [x_in.op(src_word=self._x_in_word, dst_word=X, row_words=cfg.hidden,
                                                     group_rows=1, group_stride=cfg.hidden, n_words=cfg.hidden),
                                             barrier(st, queries)]))
        for j in range(self._n):
            wb, (base, at), lw = self._layer_buf[j], self._layer_base[j], self._matrices[j]
            if "w_gate_up" in lw:  # one matvec over the gate's rows and the up's after them
                gate_up = [self._matvec(wb, base + at["w_gate_up"], lw["w_gate_up"], st, X, act, 0,
                                        x_mode="rms_norm", norm_word=base + at["ffn_norm"], seq_words=(hid, mlp))]
            else:
                gate_up = [self._matvec(wb, base + at[name], lw[name], st, X, act, y, x_mode="rms_norm",
                                        norm_word=base + at["ffn_norm"], seq_words=(hid, mlp))
                           for name, y in (("w_gate", 0), ("w_up", cfg.ffn))]
            appends = step.row_append(j) if self._qkv_appends else None
            layer_buf = self.arena.memory.layer_buffer(step.layers[j])
            # q8_0 rows, KIVI (rows.QKV_THROUGH_ROWS): the source rows (read back) and arrival words too
            through_rows = appends and appends["row_format"] in [R.QKV_FORMATS[f] for f in R.QKV_THROUGH_ROWS]
            qkv_writes = ((queries, layer_buf, rows) if through_rows else
                          (queries, layer_buf) if appends else (queries, rows))
            sections += [
                ("qkv + rope", [self._qkv(wb, base, at, lw["wqkv"], j, layer_buf, appends), barrier(*qkv_writes)]),
                ("append + attention", [*(step.attend_ops[j] if appends else step.layer_ops[j]), barrier(attn_out)]),
                ("o", [self._matvec(wb, base + at["wo"], lw["wo"], *((self._gathered, 0) if self.split_heads
                                                                     else (attn_out, step.out_word(j))),
                                    st, X, True, seq_words=(out, hid)), barrier(st)]),
                ("gate + up", [*gate_up, barrier(act)]),
                ("down", [self._matvec(wb, base + at["w_down"], lw["w_down"], act, 0, st, X, True,
                                       x_mode="swiglu", seq_words=(mlp, hid)), barrier(st)])]
        if self.last:
            sections += [("lm head", [self._matvec(self._glob, self._glob_at["output"], self._out_m, st, X, act, 0,
                                                   x_mode="rms_norm", norm_word=self._glob_at["output_norm"],
                                                   seq_words=(hid, cfg.vocab)),
                                      barrier(act)]),
                         ("argmax", self._argmax(cfg.vocab))]
        return sections

    def _qkv(self, wbuf: Buffer, base: int, at: dict, m: Matrix, j: int, layer_buf: Buffer, appends: dict | None):
        """Layer j's Q, K and V (one matrix, their rows in that order) from the normed residual,
        RoPE'd, into the step's query block and source rows — or, ``appends`` (the step's
        row_append), the keys and values into the layer buffer's rows instead."""
        cfg, step = self.config, self.step
        rows, queries, _ = step.buffers
        spec = {"FORMAT": FORMATS[m.fmt], "ROW_THREADS": min(self._row_threads, WG_SIZE // 2),
                "X_MODE": X_MODES["rms_norm"], "SEQ_TILE": self.seq_tile,
                **(step.row_append_spec(j) if appends else {})}
        k = pipeline(self.device, self._shader("fwd_qkv"),
                     [wbuf, self._state, queries, rows, self._table, self._values, layer_buf], spec,
                     max_items=self._matvec_items(m.n_rows), rows=-(-self.batch // self.seq_tile))
        return k.op(w_word=base + at["wqkv"], x_word=self._x_word, n_cols=m.n_cols, q_rows=self._n_q * cfg.head_dim,
                    k_rows=(self.heads[1] - self.heads[0]) * cfg.head_dim, y_word=step.q_word(j),
                    k_word=step.k_rows_word(j), v_word=step.v_rows_word(j), head_dim=cfg.head_dim,
                    rope_dim=cfg.rope_dim, pos_word=self._pos_word, n_pos=self._n_pos,
                    norm_word=base + at["attn_norm"], eps=cfg.rms_eps, n_ctx=self.arena.layout.n_ctx,
                    k_pre_word=step.k_pre_word(j), n_seqs=self.batch, **(appends or {}))

    # --- a token ---------------------------------------------------------------------------
    def run(self, token: int) -> int:
        """Feed ``token`` at the sequence's next position through every layer (appending its
        K/V to the arena) and return the greedy next token. A token outside the vocabulary is
        a ShapeError, a full sequence an ArenaError — before anything is written."""
        if not (self.first and self.last) or self.split_heads:
            raise E.ArenaError(f"this forward runs layers [{self.layers[0]}, {self.layers[1]}) and KV heads "
                               f"[{self.heads[0]}, {self.heads[1]}) only: SplitForward drives it")
        if self.batch != 1:
            raise E.ArenaError(f"this forward decodes a batch of {self.batch} sequences: run_batch")
        return self.run_part(token)

    def run_batch(self, tokens) -> np.ndarray:
        """:meth:`run` for every sequence of the batch: ``tokens`` (batch ints, sequence s's at
        s) each at its sequence's next position; returns each one's greedy next token (int64
        (batch,)). Checked before anything is written."""
        if not self._recs:
            raise E.ArenaError("the device forward was freed")
        toks = np.asarray(tokens)
        if toks.shape != (self.batch,) or toks.dtype.kind not in "iu" or toks.min() < 0 \
                or toks.max() >= self.config.vocab:
            raise E.ShapeError(f"DeviceForward.run_batch: expected {self.batch} tokens in 0..{self.config.vocab - 1}, "
                               f"got {tokens!r}")
        self._stage(toks, None)
        self.run_segment(0)
        return self._state_host[NEXT_WORD:NEXT_WORD + self.batch].astype(np.int64)

    def run_part(self, token: int, residual: np.ndarray | None = None):
        """:meth:`run` for a part of the layers: a later part takes the residual stream the part
        before handed back (float32 (hidden,)); a part before the last hands back its own, the
        last one the greedy next token. Checked before anything is written."""
        if self.split_heads:
            raise E.ArenaError("a forward over a range of KV heads runs a segment at a time (SplitForward)")
        self.begin(token, residual)
        return self.run_segment(0)

    @property
    def segments(self) -> int:
        """Submissions a token takes: one, or over a range of KV heads one more than layers."""
        return len(self._recs)

    def begin(self, token: int, residual: np.ndarray | None = None) -> None:
        """Stage a token (:meth:`run_part`'s checks, then its values written) for
        :meth:`run_segment` 0, 1, …; nothing is submitted."""
        if not self._recs:
            raise E.ArenaError("the device forward was freed")
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) \
                or not 0 <= int(token) < self.config.vocab:
            raise E.ShapeError(f"DeviceForward.run: token {token!r} outside 0..{self.config.vocab - 1}")
        if self.first != (residual is None):
            raise E.ShapeError("the first part takes no residual stream, a later part takes one")
        if residual is not None and (not isinstance(residual, np.ndarray) or residual.dtype != np.float32
                                     or residual.shape != (self.config.hidden,)):
            raise E.ShapeError(f"residual: expected float32 ({self.config.hidden},), got "
                               f"{getattr(residual, 'dtype', type(residual).__name__)} {getattr(residual, 'shape', '')}")
        if self.batch != 1:
            raise E.ArenaError(f"this forward decodes a batch of {self.batch} sequences: run_batch")
        self._stage(np.array([token]), residual)

    def _stage(self, tokens: np.ndarray, residual: np.ndarray | None) -> None:
        """The step's values for checked ``tokens`` (one a sequence): each sequence's position
        and every layer's n_used (DecodeStep.stage_lengths: a full sequence is an ArenaError,
        before anything is written), the residual stream of a later part."""
        used = self.step.stage_lengths()  # (layers, batch)
        B = self.batch
        self._values_host[TOKEN_WORD:TOKEN_WORD + B] = tokens
        self._values_host[self._pos_word:self._pos_word + B] = used[0] - 1
        self._values_host[self._used_word:self._x_in_word] = used.reshape(-1)
        if residual is not None:
            self._values_host[self._x_in_word:] = residual.view(np.uint32)
        self._begun = True

    def run_segment(self, i: int):
        """Submit segment ``i`` of the staged token. Before the last: layer i's attention output
        over this part's query heads, float32 (their count × head_dim), for the caller to
        gather (:meth:`set_gathered`) before segment i + 1. The last: the token is done (its
        K/V appended) — the greedy next token, or (a part before the last layers) the
        residual stream."""
        if not self._begun:
            raise E.ArenaError("run_segment without a staged token (begin)")
        self._recs[i].run()
        if i + 1 < len(self._recs):
            at = self.step.out_word(i)
            return self._out_host[at:at + self._n_q * self.config.head_dim].view(np.float32).copy()
        self._begun = False
        self.step.advance()
        if self.last:
            return int(self._state_host[NEXT_WORD])
        return self._state_host[self._x_word:self._x_word + self.config.hidden].view(np.float32).copy()

    def set_gathered(self, out: np.ndarray) -> None:
        """Every query head's attention output of the layer just attended, float32
        (n_heads × head_dim), for the next segment's O projection (a range of KV heads)."""
        n = self.config.n_heads * self.config.head_dim
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n,):
            raise E.ShapeError(f"set_gathered: expected float32 ({n},), got "
                               f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
        self._gathered_host[:] = out.view(np.uint32)

    def logits(self) -> np.ndarray:
        """The last run's logits (vocab,) float32 — a batch's (batch, vocab) — (a device forward
        made with logits=True)."""
        if not self._want_logits:
            raise E.ArenaError("this device forward reads no logits back (make it with logits=True)")
        v = self.config.vocab
        out = self._act_host[:self.batch * v].view(np.float32).reshape(self.batch, v).copy()
        return out[0] if self.batch == 1 else out

    def gpu_seconds(self) -> float | None:
        """GPU time of the last run's forward (without the copies up and back; every segment's),
        or None."""
        times = [rec.core_seconds() for rec in self._recs]
        return None if not times or None in times else float(sum(times))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights resident on the device (what a token reads, the RoPE table aside)."""
        return 4 * sum(b.words for b in {id(b): b for b in self._layer_buf + [self._glob]}.values())

    def free(self) -> None:
        """Release the recording, the buffers and the decode step. Idempotent."""
        for rec in self._recs:
            rec.free()
        self._recs = []
        self.step.free()
        for b in self._buffers:
            b.destroy()
        self._buffers.clear()

    @property
    def closed(self) -> bool:
        return not self._recs

    def __enter__(self) -> "DeviceForward":
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def _layer_matrices(layer, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> dict:
    """A layer's matrices as the forward stores them: Q, K and V as one matrix (their rows one
    after another, Q's rows [q0, q1) and K's and V's [k0, k1): a part's heads; float32 where
    their formats differ), the gate and up likewise where their formats agree, the O and down
    projections as they are."""
    qkv = [_rows(layer.wq, *q_rows), _rows(layer.wk, *kv_rows), _rows(layer.wv, *kv_rows)]
    if len({m.fmt for m in qkv}) > 1:
        qkv = [f32_matrix(dequantised(m)) for m in qkv]
    out = {"wqkv": _stacked(qkv), "wo": layer.wo, "w_down": layer.w_down}
    if layer.w_gate.fmt == layer.w_up.fmt:
        out["w_gate_up"] = _stacked([layer.w_gate, layer.w_up])
    else:
        out["w_gate"], out["w_up"] = layer.w_gate, layer.w_up
    return out


def _rows(m: Matrix, r0: int, r1: int) -> Matrix:
    return m if (r0, r1) == (0, m.n_rows) else Matrix(m.fmt, r1 - r0, m.n_cols, m.words[r0:r1])


def _stacked(ms) -> Matrix:
    return Matrix(ms[0].fmt, sum(m.n_rows for m in ms), ms[0].n_cols, np.concatenate([m.words for m in ms]))
