"""The recorded operations of one decode attention (kvdict_vk.vk.attend.engine): pipelines, push
constants and barriers for each plan (kvdict_vk.vk.attend.plan).

Pipelines are made once per (pass, layer or row buffer) — Kompute binds buffers when a
pipeline is created — and kept until the arena is freed. Operations whose push constants do
not depend on the token count (the q·atom table, the syncs, the passes after the splits
for a given split count) are made once and re-recorded; the others (the split passes,
whose push constants carry n_used) are made per call — Kompute bakes push constants into
the command buffer when recording, and a sequence cannot be re-recorded under the
validation layer (its command pool lacks the reset flag), so a decode step records a fresh
sequence of mostly cached operations.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import errors as E
from .flash import INT_DOT_KERNEL, MMA_KERNEL
from .plan import LOOP_BUDGET
from .specs import flash_coded_key_lanes, merge_head_local, n_blocks
from ..device import kp
from ..kernels import Kernel, barrier, pipeline

OP_CACHE_LIMIT = 1024  # cached operations per engine; cleared when exceeded (never in steady decode)
WINDOW_LOCAL = 64  # attend_window's workgroup on every device: a window row an invocation, (row group, quad) pairs for p·v


@dataclass(frozen=True)
class Placement:
    """Where a flash attention reads its query block and writes its output (words into the
    query and output buffers), and whether each sequence's tokens come from its n_used word
    alone, the splits following it (``dynamic``: push split_len 0, attend_common.glsl's
    SPLIT_LEN). A decode step recorded once (kvdict_vk.vk.arena.decode) places every layer's
    attention in shared buffers so; every other attention is ``AT_START``."""
    q_word: int = 0
    out_word: int = 0
    dynamic: bool = False


AT_START = Placement()


@dataclass(frozen=True)
class F32Rows:
    """A stream of f32 rows outside the layer buffer (what a StreamLayout says of a
    passthrough stream, for the reconstruct-then-attend baseline)."""
    coded: bool = False
    sparsity: int = 0
    residual_bits: int = 0
    has_mean: bool = False
    head_atoms_stride: int = 0
    head_vec_stride: int = 0
    half: bool = False
    q8: bool = False
    rows: str = "f32"
    atoms_f16: bool = False
    windowed: bool = False
    key_rope: None = None  # read-out keys are turned already


class PassBuilder:
    """The passes of one engine, given explicitly what they bind and read: ``memory`` (the
    arena's memory: device, layout, seq_ctx, layer_buffer(layer), upload_buffer), ``buffers``
    (attend.buffers.AttendBuffers: the engine's scratch and their Sizes), ``shapes``
    (attend.flash.FlashShapes: the flash kernels' sizes and builds) and ``grid``
    (attend.plan.Grid: group, head block, units, workgroup, splits)."""

    def __init__(self, memory, buffers, shapes, grid):
        self.memory, self.buffers, self.shapes, self.grid = memory, buffers, shapes, grid
        self.layout, self.device = memory.layout, memory.device
        self._kernels: dict = {}
        self._ops: dict = {}

    # --- pipelines and operations -------------------------------------------------------------
    def pipeline_keys(self) -> set:
        """The keys of the pipelines (and read plans) built so far: a steady decode adds none."""
        return set(self._kernels)

    def _kernel(self, key, shader: str, buffers, items: int, **spec) -> Kernel:
        # the device's pipeline (shared with any owner that asks for the same), memoised by
        # this builder's key so a steady decode looks nothing up
        if key not in self._kernels:
            grid = self.grid
            spec = {"HEAD_DIM": self.layout.head_dim, "GROUP": grid.group, "LOCAL": grid.local, "HB": grid.hb, **spec}
            self._kernels[key] = pipeline(self.device, shader, buffers, spec, max_items=items)
        return self._kernels[key]

    def _cached_op(self, key, kernel: Kernel, **push):
        """kernel.op(**push), made once per (kernel, push constants)."""
        k = (key, tuple(sorted(push.items())))
        op = self._ops.get(k)
        if op is None:
            if len(self._ops) >= OP_CACHE_LIMIT:
                self._ops.clear()
            op = self._ops[k] = kernel.op(**push)
        return op

    def _buffer_op(self, what: str, buffers, make):
        """``make()``, the op ``what`` over ``buffers``, made once and kept with the others."""
        k = (what,) + tuple(b.uid for b in buffers)
        op = self._ops.get(k)
        if op is None:
            op = self._ops[k] = make()
        return op

    def sync(self, *buffers):
        """The compute→compute barrier on what was just written (kernels.barrier)."""
        return self._buffer_op("sync", buffers, lambda: barrier(*buffers))

    def q_upload(self, buf):
        """The copy of the query from its staging buffer to the device (once per submission)."""
        return self._buffer_op("q_upload", (buf,), lambda: kp.OpTensorSyncDevice([buf.tensor]))

    def read_back(self, buf):
        """The copy of ``buf`` to its staging buffer, for the host (once per submission)."""
        return self._buffer_op("read_back", (buf,), lambda: kp.OpTensorSyncLocal([buf.tensor]))

    # --- the direct path ------------------------------------------------------------------------
    def _direct(self, key, cache, k, v, source: dict, plan, n_used: int, n_cached: int, t_first: int,
                n_splits: int, split_len: int, split0: int, scale: float, fresh_words=(0, 0)):
        """One attend_direct dispatch over tokens [t_first, n_used) of `cache` (k, v: its
        streams' StreamLayouts, or None for f32 rows at source's k_word / v_word)."""
        b, grid, lay = self.buffers, self.grid, self.layout
        upload = self.memory.upload_buffer
        if k.half != v.half or k.q8 or v.q8:
            raise E.ArenaError("attend_direct reads K and V rows in one format, f16 or f32 (q8_0: attend_flash)")
        spec = dict(K_SPARSITY=k.sparsity if k.coded else 0, K_BITS=k.residual_bits,
                    V_SPARSITY=v.sparsity if v.coded else 0, V_BITS=v.residual_bits, ROW_HALF=int(k.half),
                    ATOMS_F16=int(k.atoms_f16 or v.atoms_f16), K_ROPE=int(k.key_rope is not None))
        kernel = self._kernel(("direct",) + key, "attend_direct",
                              [cache, cache, upload, upload, b.q, b.accs, b.stats, b.out],
                              grid.units * grid.max_splits, **spec)
        write_out = int(plan.write_out and t_first == 0 and not k.windowed)
        use_mean = int(write_out and v.coded and v.has_mean)
        return kernel.op(**source, fresh_k_word=fresh_words[0], fresh_v_word=fresh_words[1], t_first=t_first,
                         n_used=n_used, n_cached=n_cached, split_len=split_len, n_splits=n_splits, split0=split0,
                         n_kv=lay.n_kv_heads, n_atoms=max(lay.n_atoms, 1),
                         k_atoms_word=k.atoms_word if k.coded else 0, v_atoms_word=v.atoms_word if v.coded else 0,
                         head_atoms=k.head_atoms_stride, k_scale_word=k.scale_word if k.residual_bits else 0,
                         v_scale_word=v.scale_word if v.residual_bits else 0, head_vec=k.head_vec_stride,
                         write_out=write_out, use_mean=use_mean, mean_word=v.mean_word if use_mean else 0,
                         **_window_push(k), **_rope_push(k), score_scale=scale)

    def _merge(self, key, buf, v, records: int, per_head: bool = False, n_seqs: int = 1, out_word: int = 0) -> list:
        """attend_merge (one invocation per output quad: the direct path's, shaped for CPU
        drivers) or, ``per_head`` (the flash paths), attend_merge_head (a workgroup per query
        head, of each of n_seqs sequences) where its workgroup fits the device — its output
        from ``out_word`` of the output buffer on."""
        b, grid, lay = self.buffers, self.grid, self.layout
        use_mean = int(v is not None and v.coded and v.has_mean)
        n_heads = b.sizes.seqs * lay.n_kv_heads * grid.group
        local = merge_head_local(lay.head_dim, self.shapes.max_local()) if per_head else 0
        mean = dict(use_mean=use_mean, mean_word=v.mean_word if use_mean else 0,
                    head_vec=v.head_vec_stride if use_mean else 0)
        if local:
            kernel = self._kernel(("merge_head",) + key, "attend_merge_head", [buf, b.stats, b.accs, b.out],
                                  n_heads * local, LOCAL=local)
            op = self._cached_op(("merge", local) + key, kernel, n_kv=n_seqs * lay.n_kv_heads, n_splits=records,
                                 seq_heads=lay.n_kv_heads, out_word=out_word, **mean)
        else:
            if n_seqs > 1 or out_word:
                raise E.ArenaError(f"{self.device.name}: a batched or recorded step's attention merges with "
                                   f"attend_merge_head, whose workgroup does not fit this device")
            kernel = self._kernel(("merge",) + key, "attend_merge", [buf, b.stats, b.accs, b.out],
                                  n_heads * lay.head_dim // 4)
            op = self._cached_op(("merge", local) + key, kernel, n_kv=lay.n_kv_heads, n_splits=records, **mean)
        return [self.sync(b.stats, b.accs), op]

    # --- one attention ------------------------------------------------------------------------------
    def ops(self, layer: int, plan, n_used: int, n_cached: int, scale: float, fresh_words=(0, 0)) -> list:
        """The operations of one attention over tokens [0, n_used) of ``layer``, those from
        n_cached on fresh (in the upload buffer at fresh_words)."""
        lay = self.layout
        k, v = lay.layers[layer].streams
        buf = self.memory.layer_buffer(layer)
        source = dict(k_word=k.region_word, v_word=v.region_word, n_ctx=lay.n_ctx)
        key = ("layer", layer)
        if plan.path == "flash":  # reads the layer only: a step's scatter and barrier come first
            return self.flash_ops(layer, plan, n_used, scale)
        if plan.path == "direct":
            ops = [self._direct(key, buf, k, v, source, plan, n_used, n_cached, 0, plan.n_splits, plan.split_len,
                                0, scale, fresh_words)]
            if k.windowed:  # after the coded pass, a barrier between: both write the records
                return ops + [self.sync(self.buffers.accs, self.buffers.stats)] \
                    + self._window_ops(layer, plan.records, n_used, scale) + self._merge(key, buf, v, plan.records + 1)
            return ops if plan.write_out else ops + self._merge(key, buf, v, plan.records)
        ops = self._table_ops(layer, plan, n_cached, scale)
        if plan.fresh_splits:  # a step's new tokens: records after the split pass's
            ops.append(self._direct(key, buf, k, v, source, plan, n_used, n_cached, n_cached, plan.fresh_splits,
                                    plan.fresh_len, plan.n_splits, scale, fresh_words))
        return ops + self._table_tail(layer, plan)

    def flash_ops(self, layer: int, plan, n_used: int, scale: float, at: Placement = AT_START) -> list:
        """attend_flash (an uncoded layer) or attend_table + attend_flash_coded (a dict-coded
        one) over tokens [0, n_used), then attend_merge_head; the query block and the output
        placed ``at`` (Placement: a recorded decode step's; each sequence's tokens then its
        n_used word, ≤ n_used)."""
        lay = self.layout
        k, v = lay.layers[layer].streams
        buf = self.memory.layer_buffer(layer)
        if k.coded:
            return self._flash_coded_ops(layer, plan, n_used, scale, at)
        source = dict(k_word=k.region_word, v_word=v.region_word, n_ctx=lay.n_ctx, seq_rows=self.memory.seq_ctx)
        local = plan.local or self.shapes.flash_local(layer)
        if k.kivi:  # the KIVI build: the layer's statistics, exact windows (binary16 rows) and state word
            source.update(stats_word=k.stats_word, k_window_word=k.window_word, v_window_word=v.window_word,
                          window=k.window_tokens, state_word=k.state_word)
            return self._flash_rows(("layer", layer), buf, None, source, local, 1, 0, plan, n_used, scale,
                                    kivi=(k.kivi_bits, v.kivi_bits), at=at)
        return self._flash_rows(("layer", layer), buf, v, source, local, int(k.half), int(k.q8), plan, n_used, scale,
                                at=at)

    def _flash_rows(self, key, buf, v, source: dict, local: int, half: int, q8: int, plan, n_used: int,
                    scale: float, kivi: tuple | None = None, at: Placement = AT_START) -> list:
        """attend_flash over rows in ``buf`` (K at source's k_word, V at its v_word, n_ctx
        rows per KV head; plan.seqs sequences seq_rows apart) — its KIVI build where ``kivi``
        gives (K bits, V bits) —, then attend_merge_head."""
        b, grid, lay = self.buffers, self.grid, self.layout
        variant = self.shapes.flash_variant(local, flash_shader(bool(kivi), plan.kernel))
        # attend_mma has no split end through shared memory to size
        end = {} if plan.kernel == MMA_KERNEL else dict(END_ELEMS=self.shapes.flash_end_elems(local, plan.kernel))
        bits = dict(K_BITS=kivi[0], V_BITS=kivi[1]) if kivi else {}
        kernel = self._kernel(("flash", variant) + key + (local, end.get("END_ELEMS", 0)), variant,
                              [buf, buf, b.q, b.accs, b.stats],
                              b.sizes.seqs * lay.n_kv_heads * grid.max_splits * local, LOCAL=local, HB=1,
                              ROW_HALF=half, ROW_Q8=q8, **end, **bits)
        op = kernel.op(**source, n_used=n_used, n_splits=plan.n_splits, n_kv=lay.n_kv_heads, n_seqs=plan.seqs,
                       score_scale=scale, q_word=at.q_word, **_split_push(plan, at))
        return [op] + self._merge(key, buf, v, plan.records, per_head=True, n_seqs=plan.seqs, out_word=at.out_word)

    def variant(self, layer: int, plan) -> str:
        """The SPIR-V variant that runs ``plan``'s attention over ``layer`` (its main pass)."""
        k = self.layout.layers[layer].k
        if plan.path != "flash":
            return "attend_direct" if plan.path == "direct" else "attend_split_coded"
        if k.coded:
            return "attend_flash_coded"
        return self.shapes.flash_variant(plan.local or self.shapes.flash_local(layer), flash_shader(k.kivi, plan.kernel))

    def _flash_coded_ops(self, layer: int, plan, n_used: int, scale: float, at: Placement = AT_START) -> list:
        b, grid, lay = self.buffers, self.grid, self.layout
        k, v = lay.layers[layer].streams
        n_kv, buf = lay.n_kv_heads, self.memory.layer_buffer(layer)
        turned = k.key_rope is not None  # the K_ROPE build decodes and turns each key: no table
        ops = []
        if not turned:  # the q·atom table of every (KV head, query head): an invocation per atom and head block
            table = self._kernel(("table_all", layer), "attend_table", [buf, b.q, b.table],
                                 b.sizes.seqs * grid.units * lay.n_atoms, ATOMS_F16=int(k.atoms_f16))
            ops.append(self._cached_op(("table_all", layer), table, atoms_word=k.atoms_word,
                                       head_atoms=k.head_atoms_stride, n_atoms=lay.n_atoms, n_kv=n_kv,
                                       n_seqs=plan.seqs, q_word=at.q_word))
        records = plan.records
        if k.windowed:  # beside the table, before the coded pass: its record after the splits'
            ops = self._window_ops(layer, records, n_used, scale, at) + ops
            records += 1
        written = ((b.accs, b.stats) if k.windowed else ()) + (() if turned else (b.table,))
        if written:
            ops.append(self.sync(*written))
        # the plan's kernel, heads and size (0: the kernel's first heads, their first size)
        options = self.shapes.flash_coded_options(layer, plan.kernel)
        hb = plan.heads or options[0][0]
        local = plan.local or dict(options)[hb][0]
        variant = "attend_flash_coded"  # CODED_KERNELS' one kernel
        kernel = self._kernel(("flash_coded", variant, layer, local, hb), variant,
                              [buf, buf, b.table, b.q, b.accs, b.stats],
                              b.sizes.seqs * n_kv * (grid.group // hb) * grid.max_splits * local, LOCAL=local, HB=hb,
                              K_BITS=k.residual_bits, V_BITS=v.residual_bits, N_ATOMS=lay.n_atoms,
                              K_SPARSITY=k.sparsity, V_SPARSITY=v.sparsity, ATOMS_F16=int(v.atoms_f16),
                              BUCKET=self.shapes.flash_coded_bucket(layer, hb, local), K_ROPE=int(turned),
                              KEY_LANES=flash_coded_key_lanes(lay.head_dim, k.atoms_f16, lay.n_atoms, local)
                              if turned else 1)
        ops.append(kernel.op(k_word=k.region_word, v_word=v.region_word, n_ctx=lay.n_ctx, n_used=n_used,
                             n_splits=plan.n_splits, n_kv=n_kv, v_atoms_word=v.atoms_word, **_split_push(plan, at),
                             head_atoms=v.head_atoms_stride, k_scale_word=k.scale_word if k.residual_bits else 0,
                             v_scale_word=v.scale_word if v.residual_bits else 0, head_vec=k.head_vec_stride,
                             n_seqs=plan.seqs, seq_rows=self.memory.seq_ctx, score_scale=scale, q_word=at.q_word,
                             **_window_push(k), **_rope_push(k), **({"k_atoms_word": k.atoms_word} if turned else {})))
        return ops + self._merge(("layer", layer), buf, v, records, per_head=True, n_seqs=plan.seqs,
                                 out_word=at.out_word)

    def _window_ops(self, layer: int, split0: int, n_used: int, scale: float, at: Placement = AT_START) -> list:
        """attend_window over a windowed layer's exact window (kvdict_vk.window): its records
        at split split0. The caller orders it against the coded pass (both write the records)."""
        b, lay = self.buffers, self.layout
        k, v = lay.layers[layer].streams
        win = k.exact_window
        kernel = self._kernel(("window", layer), "attend_window", [self.memory.layer_buffer(layer), b.q, b.accs, b.stats],
                              lay.n_kv_heads * self.grid.group * WINDOW_LOCAL, HB=1, LOCAL=WINDOW_LOCAL)
        return [kernel.op(
            k_window_word=k.window_word, v_window_word=v.window_word, rows=win.rows, sink=win.sink,
            recent=win.recent, state_word=k.state_word, k_mean_word=k.mean_word, v_mean_word=v.mean_word,
            head_vec=k.head_vec_stride, n_kv=lay.n_kv_heads, n_used=n_used, split0=split0, q_word=at.q_word,
            score_k_mean=int(k.key_rope is not None), score_scale=scale)]

    def rows_ops(self, rows, plan, n_used: int, scale: float) -> list:
        """``plan`` ("flash" or "direct") over f32 rows in ``rows``: K at word 0, V after it,
        n_used tokens per KV head (reconstruct-then-attend)."""
        lay = self.layout
        source = dict(k_word=0, v_word=lay.n_kv_heads * n_used * lay.head_dim, n_ctx=n_used)
        key = ("rows", id(rows))
        if plan.path == "flash":
            return self._flash_rows(key, rows, None, source, plan.local, 0, 0, plan, n_used, scale)
        ops = [self._direct(key, rows, F32Rows(), F32Rows(), source, plan, n_used, n_used, 0, plan.n_splits, plan.split_len,
                            0, scale)]
        return ops if plan.write_out else ops + self._merge(key, rows, None, plan.records)

    # --- the table path ---------------------------------------------------------------------------
    def _table_ops(self, layer: int, plan, n_cached: int, scale: float) -> list:
        """attend_table (K dict-coded), then attend_split_coded over the cached tokens."""
        b, grid, lay = self.buffers, self.grid, self.layout
        n_kv, buf = lay.n_kv_heads, self.memory.layer_buffer(layer)
        k, v = lay.layers[layer].streams
        ops = []
        if k.coded:
            # a few contiguous runs of atoms per hardware thread (the query reload is the
            # cost), each within the loop budget
            runs = max(grid.preferred_splits * grid.units, -(-grid.units * lay.n_atoms // (LOOP_BUDGET // 2)))
            table = self._kernel(("table", layer), "attend_table", [buf, b.q, b.table],
                                 min(grid.units * lay.n_atoms, runs), ATOMS_F16=int(k.atoms_f16))
            ops += [self._cached_op(("table", layer), table, atoms_word=k.atoms_word, head_atoms=k.head_atoms_stride,
                                    n_atoms=lay.n_atoms, n_kv=n_kv), self.sync(b.table)]
        spec = dict(K_CODED=int(k.coded), K_BITS=k.residual_bits, V_CODED=int(v.coded), V_BITS=v.residual_bits)
        # unused bindings: the query (read-only) for the table, a dummy for the weights
        split = self._kernel(("split_coded", layer), "attend_split_coded",
                             [buf, buf, b.q, b.accs, b.stats, b.table if k.coded else b.q,
                              b.bins if v.coded else b.dummy, b.scores], grid.units * grid.max_splits, **spec)
        ops.append(split.op(k_word=k.region_word, v_word=v.region_word, n_ctx=lay.n_ctx, n_used=n_cached,
                            split_len=plan.split_len, n_splits=plan.n_splits, n_kv=n_kv, n_atoms=max(lay.n_atoms, 1),
                            k_sparsity=k.sparsity if k.coded else 0, v_sparsity=v.sparsity if v.coded else 0,
                            k_scale_word=k.scale_word if k.residual_bits else 0,
                            v_scale_word=v.scale_word if v.residual_bits else 0,
                            head_vec=k.head_vec_stride, score_scale=scale))
        return ops

    def _table_tail(self, layer: int, plan) -> list:
        """attend_combine → attend_atoms (V dict-coded) → attend_reduce over plan.records splits."""
        b, grid, lay = self.buffers, self.grid, self.layout
        sz = b.sizes
        n_kv, buf, records = lay.n_kv_heads, self.memory.layer_buffer(layer), plan.records
        v = lay.layers[layer].v
        ops = [self.sync(b.stats, b.accs, *([b.bins] if v.coded else []))]
        combine = self._kernel(("combine",), "attend_combine", [b.stats], n_kv * grid.group)
        ops += [self._cached_op(("combine",), combine, n_kv=n_kv, n_splits=records, f_word=sz.f_word,
                                inv_l_word=sz.inv_l_word), self.sync(b.stats)]
        if v.coded:  # the atom weights times the atoms (and the bins cleared for the next call)
            atoms = self._kernel(("atoms", layer), "attend_atoms", [buf, b.stats, b.bins, b.blocks],
                                 grid.units * n_blocks(lay.n_atoms), ATOMS_F16=int(v.atoms_f16))
            ops += [self._cached_op(("atoms", layer), atoms, atoms_word=v.atoms_word, head_atoms=v.head_atoms_stride,
                                    n_atoms=lay.n_atoms, n_kv=n_kv, n_splits=records, f_word=sz.f_word),
                    self.sync(b.blocks)]
        reduce = self._kernel(("reduce", layer), "attend_reduce",
                              [buf, b.stats, b.accs, b.blocks if v.coded else b.accs, b.out],
                              n_kv * grid.group * lay.head_dim // 4)
        use_mean = v.coded and v.has_mean
        ops.append(self._cached_op(("reduce", layer), reduce, n_kv=n_kv, n_splits=records, f_word=sz.f_word,
                                   inv_l_word=sz.inv_l_word, n_blocks=n_blocks(lay.n_atoms) if v.coded else 0,
                                   use_mean=int(use_mean), mean_word=v.mean_word if use_mean else 0,
                                   head_vec=v.head_vec_stride if use_mean else 0))
        return ops

    # --- the reconstruct-then-attend baseline ---------------------------------------------------
    def reconstruct_plan(self, layer: int, n_used: int, out):
        key = ("recon_plan", layer, n_used)
        if key not in self._kernels:
            from ..read.reader import ReadPlan
            for old in [k for k in self._kernels if k[0] == "recon_plan"]:
                del self._kernels[old]  # its pipelines are the device's
            self._kernels[key] = ReadPlan(self.memory, layer, 0, n_used, out=out)
        return self._kernels[key]

    def free(self) -> None:
        """Forget the operations; the pipelines go with the buffers they bind."""
        self._ops.clear()
        self._kernels.clear()


def _window_push(st) -> dict:
    """The coded passes' window fields for a stream of a windowed layer (none otherwise)."""
    if not st.windowed:
        return {}
    win = st.exact_window
    return dict(win_sink=win.sink, win_recent=win.recent, state_word=st.state_word)


def _rope_push(st) -> dict:
    """attend_direct's and attend_flash_coded's fields for a K stream coded before RoPE
    (kvdict_vk.rope; none otherwise)."""
    if st.key_rope is None:
        return {}
    return dict(k_mean_word=st.mean_word, rope_word=st.rope_word, rope_hi=st.rope_hi_rows,
                rope_shift=st.rope_shift)


def _split_push(plan, at: Placement) -> dict:
    """A flash dispatch's split length — the plan's, or (``at.dynamic``) 0: SPLIT_LEN — and
    the plan's rounding (the KIVI builds' quantised splits are whole rounds of it)."""
    return dict(split_len=0 if at.dynamic else plan.split_len, split_round=plan.split_round)


def flash_shader(kivi: bool, kernel: str) -> str:
    """The shader of a flash build over rows: attend_mma (build "mma", its KIVI build over a KIVI
    layer), or attend_flash — its KIVI build, its wide end (build "wide_end"), its integer dot
    products over q8_0 keys (build "int_dot") or itself."""
    if kernel == MMA_KERNEL:
        return "attend_mma_kivi" if kivi else "attend_mma"
    if kivi:
        return "attend_flash_kivi"
    return {"wide_end": "attend_flash_wide", INT_DOT_KERNEL: "attend_flash_dot"}.get(kernel, "attend_flash")
