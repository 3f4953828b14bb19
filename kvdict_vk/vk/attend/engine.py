"""Decode attention over a KvArena's cache — the same call in both cache modes.

``KvArena.attend(layer, q, n_used, scale=None)`` attends one new query token per call:
q (n_heads, head_dim) float32, grouped-query (query head h reads KV head h // (n_heads /
n_kv_heads)), causal over the first ``n_used`` cached tokens, softmax(scale · q·k) with the
maximum subtracted; returns (n_heads, head_dim) float32. ``KvArena.step`` appends the new
tokens and attends over them in the same submission. The NumPy twin is
``kvdict_vk.attention_ref.attend`` / ``attend_coded``.

Two exact paths (kvdict_vk.vk.attend.plan chooses by a cost model; ``Attention.path``
forces one): *direct* — attend_direct decodes each key and value (f32 rows for a
passthrough stream: that is the f32 cache's path) with an online softmax, then attend_merge
unless one split covered everything; *table* — attend_table → attend_split_coded →
attend_combine → attend_atoms (dict-coded V) → attend_reduce, never decoding a key or value
(shaders/attend_split.comp says how). Long contexts are split into chunks of tokens
(flash-decoding); each (KV head, block of query heads, split) is one invocation writing a
record (attend_common.glsl) that the last passes merge. On GPUs the flash kernels
(kvdict_vk.vk.attend.flash: their launch shapes) attend instead. A KIVI layer attends by
attend_flash's KIVI build over its words (every device), or — ``path`` "rows" — by reading
its rows out to f32 and attending over those (attend_reconstructed). A dict-coded layer with
an exact window (kvdict_vk.window) attends by attend_flash_coded (GPUs) or attend_direct (CPU
drivers), which skip the window's tokens, and attend_window over those, one more record for the
merge; or — ``path`` "rows", or a layer with a passthrough stream — read out, the window's rows
over the slots' (read_window.comp).

Between dependent dispatches of one submission we record a compute→compute barrier on
the buffers just written (kvdict_vk.vk.kernels.barrier: Kompute's OpMemoryBarrier, which
scripts/setup.sh binds for Python). A step's new tokens are read from the upload buffer
(attend_direct's fresh rows) rather than from the layer the step's scatter writes them
into, so no dispatch of a step waits on the scatter.

The engine owns three explicit parts, which its passes (kvdict_vk.vk.attend.ops.PassBuilder)
receive: its buffers (attend.buffers.AttendBuffers), the flash launch shapes
(attend.flash.FlashShapes) and how it divides an attention (attend.plan.Grid). Of the arena it
uses its memory only — ``device, layout, seq_ctx, seqs, shader_mapping, check_live(),
n_tokens(layer), layer_buffer(layer), upload_buffer`` — so a KvArena or its memory object
serves alike.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ... import errors as E
from . import plan as P
from .plan import LOOP_BUDGET, loop_iterations  # noqa: F401 (re-exported: tests, tools)
from .buffers import AttendBuffers
from .flash import CODED_KERNELS, FLASH_KERNELS, FlashShapes, max_local  # noqa: F401 (re-exported: tests, tools)
from .ops import PassBuilder
from .specs import FLASH_MAX_GROUP, Sizes
from . import tune as T
from ..submit import Recording, timestamps_usable

MAX_SPLITS = 128  # per KV head
CPU_SIMD_LANES = 8  # 32-bit lanes of llvmpipe's 256-bit vectors: the workgroup size on CPU drivers
SPLIT_LANES_PER_CPU = 8  # CPU drivers: splits (over all KV heads) per hardware thread
GPU_LOCAL = 64
HEAD_BLOCK_FLOATS = 192  # query (and accumulator) floats an invocation keeps for its block of heads
BINS_BUDGET_WORDS = 1 << 24  # the atom weights of all splits: at most 64 MiB
PATHS = (None, "direct", "table", "flash", "rows")  # "rows": a KIVI or windowed layer read out, then attended


def head_block(group: int, head_dim: int) -> int:
    """Query heads per invocation: the largest divisor of the group whose query and
    accumulator state (HB × head_dim floats each) stays within HEAD_BLOCK_FLOATS — more
    heads per invocation share each loaded key/value, but llvmpipe's compile time grows
    quickly with private state (attend_common.glsl)."""
    return max(d for d in range(1, group + 1) if group % d == 0 and (d == 1 or d * head_dim <= HEAD_BLOCK_FLOATS))


def _forward(part: str, name: str, doc: str) -> property:
    """A read-write attribute of the engine kept by one of its parts (``part``.``name``)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class Attention:
    """Decode attention for one arena's memory and one query-head count (buffers and
    pipelines are made on first use and kept until the arena is freed)."""

    # the flash launch shapes' settings (FlashShapes says what each fixes); tests and benchmarks set them here
    coded_workgroups = _forward("shapes", "coded_workgroups", "attend_flash_coded's workgroups (None: tuned)")
    flash_workgroups = _forward("shapes", "flash_workgroups", "attend_flash's workgroups (None: tuned)")
    coded_heads = _forward("shapes", "coded_heads", "attend_flash_coded's query heads per workgroup (None: tuned)")
    coded_kernel = _forward("shapes", "coded_kernel", "the kernel over the codes (CODED_KERNELS; None: tuned)")
    flash_kernel = _forward("shapes", "flash_kernel", "attend_flash's build (FLASH_KERNELS; None: tuned)")
    subgroups = _forward("shapes", "subgroups", "attend_flash by subgroup shuffles (None: where they fit)")
    exact = _forward("shapes", "exact", "only the exact builds, float32 throughout (False: the tuner may pick a "
                     "fast path that meets issue 50's gate, NMSE ≤ 1e-5)")
    compute_units = _forward("shapes", "compute_units", "the multiprocessors the workgroup counts are of")
    # how the engine divides an attention (plan.Grid)
    local = property(lambda self: self.grid.local, doc="the direct and table passes' workgroup size")
    max_splits = property(lambda self: self.grid.max_splits, doc="records per KV head the buffers hold")
    preferred_splits = _forward("grid", "preferred_splits", "splits per KV head the plans aim at")
    # the query block and the output (AttendBuffers)
    q = property(lambda self: self.buffers.q, doc="the query block's buffer")
    out = property(lambda self: self.buffers.out, doc="the output's buffer")

    def __init__(self, memory, n_heads: int):
        lay = memory.layout
        if lay.head_dim % 4:
            raise E.ArenaError(f"GPU attention needs head_dim % 4 == 0 (vec4 rows), got {lay.head_dim}")
        if lay.mode == "f16" and lay.head_dim % 8:
            raise E.ArenaError(f"GPU attention over an f16 cache needs head_dim % 8 == 0 (a vec4 of words "
                               f"is 8 halves), got {lay.head_dim}")
        self.memory, self.device, self.layout = memory, memory.device, lay
        self.n_heads, group = n_heads, n_heads // lay.n_kv_heads
        hb = head_block(group, lay.head_dim)
        n_kv, hd = lay.n_kv_heads, lay.head_dim
        units = n_kv * (group // hb)  # (KV head, head block) pairs
        self.path = None  # None: the cost model chooses; "direct" / "table" forces a path
        self.any_k_coded = any(ll.k.coded for ll in lay.layers)
        self.any_v_coded = any(ll.v.coded for ll in lay.layers)
        # The memory's shader mapping says which machine to plan for: "row" (CPU drivers:
        # a workgroup per SIMD row, a few splits per thread) or "chunk" (GPUs).
        cpu = memory.shader_mapping == "row"
        self.tune = not cpu  # measure the flash kernels' launch shape (attend_tune)
        compute_units = self.device.limit("compute_units") or 0
        # Preferred splits per KV head: enough to give every hardware thread a full SIMD row
        # (CPU drivers) or to fill a GPU. Capacity (records per KV head): what any plan of
        # the longest context needs; the atom weights' memory caps it.
        want = SPLIT_LANES_PER_CPU * (os.cpu_count() or 2) if cpu else 1024
        preferred = max(1, min(MAX_SPLITS, -(-want // units)))
        # a batched arena: memory.seqs sequences of memory.seq_ctx tokens each (n_ctx rows per head in all)
        self.seqs, seq_ctx = memory.seqs, memory.seq_ctx
        needed = max(P.max_records(ll.k, ll.v, seq_ctx, preferred) for ll in lay.layers)
        if not cpu:  # attend_flash's splits: its most workgroups over the KV heads
            needed = max(needed, min(MAX_SPLITS, max(T.workgroup_counts(compute_units, False)) // n_kv))
        if needed > MAX_SPLITS + 1:
            raise E.ArenaTooLargeError(f"attention over {seq_ctx} tokens needs {needed} splits per KV head "
                                       f"(at most {MAX_SPLITS}); use a shorter context or a lower sparsity")
        if self.any_v_coded:
            per_split = n_kv * group * lay.n_atoms
            cap = min(BINS_BUDGET_WORDS, self.device.limit("max_storage_buffer_range") // 4) // per_split
            if cap < needed:
                raise E.ArenaTooLargeError(f"{self.device.name}: the atom weights of {needed} splits "
                                           f"({needed * per_split} words) exceed the budget")
        self.grid = P.Grid(group, hb, units, CPU_SIMD_LANES if cpu else GPU_LOCAL, preferred, needed)
        self.shapes = FlashShapes(self.device, lay, group, needed)
        self._warm_layers: set[int] = set()
        self.passes = None
        # a windowed layer's attend_window writes one record after the coded pass's splits
        window_record = int(any(ll.windowed for ll in lay.layers))
        sizes = Sizes(n_kv, group, hd, max(lay.n_atoms, 1), seq_ctx, needed + window_record, self.seqs)
        self.buffers = AttendBuffers(self.device, sizes, n_heads, self.any_k_coded, self.any_v_coded)
        self.passes = PassBuilder(memory, self.buffers, self.shapes, self.grid)

    def max_local(self) -> int:
        """The largest one-dimensional workgroup the device allows (flash.max_local)."""
        return max_local(self.device)

    # --- planning ---------------------------------------------------------------------------------
    def plan(self, layer: int, n_used: int, n_cached: int | None = None, path: str | None = None,
             seqs: int = 1) -> P.Plan:
        """How an attention over tokens [0, n_used) of ``layer`` runs, n_cached of them
        (default: all) in the cache and the rest fresh (a step's new tokens); ``path``
        (default: ``self.path``) forces "direct" or "table". ``seqs`` > 1: a batched
        attention of that many sequences, n_used the longest (the flash kernels only)."""
        path = self.path if path is None else path
        if seqs > 1:
            if path not in (None, "flash") or not self.shapes.flash_fits(layer):
                raise E.ArenaError(f"layer {layer}: batched attention runs the flash kernels only, which "
                                   f"{'were not asked for' if path not in (None, 'flash') else 'do not fit it'}")
            return self.flash_plan(layer, n_used, seqs)
        if path not in PATHS:
            raise E.ArenaError(f"Attention.path must be one of {PATHS}, got {path!r}")
        k, v = self.layout.layers[layer].streams
        windowed = self.layout.layers[layer].windowed
        if windowed and not (k.windowed and v.windowed):
            raise E.ArenaError(f"layer {layer}: a windowed layer with a passthrough stream attends by its read-out "
                               f"path only (Attention.attend_reconstructed, KvArena.attend)")
        if windowed and path in ("table", "rows"):
            raise E.ArenaError(f"layer {layer}: a windowed dictionary layer attends by attend_flash_coded or "
                               f"attend_direct beside attend_window, or read out (Attention.attend_reconstructed); "
                               f"not by the {path} path")
        if k.kivi:  # attend_flash_kivi over the words; the read-out path is attend_reconstructed's
            if path in ("direct", "table", "rows"):
                raise E.ArenaError(f"layer {layer}: a KIVI layer attends by attend_flash_kivi (path None or "
                                   f"'flash'); its read-out path ({path!r}) runs in Attention.attend_reconstructed")
            if not self.shapes.flash_fits(layer):
                raise E.ArenaError(f"layer {layer}: attend_flash_kivi cannot attend over it here (head_dim "
                                   f"{self.layout.head_dim}, {self.grid.group} query heads per KV head, at most "
                                   f"{FLASH_MAX_GROUP}); Attention.attend_reconstructed can")
            return self.flash_plan(layer, n_used)
        if path == "rows":
            raise E.ArenaError(f"layer {layer}: path 'rows' (read out, then attend) is a KIVI or windowed layer's only")
        n_cached = n_used if n_cached is None else n_cached
        # GPUs: the flash kernels (a workgroup per split and KV head) over uncoded rows and
        # over layers whose streams are both coded; CPU drivers keep attend_direct and the
        # table path, shaped for them (attend_common.glsl says why); q8_0 rows: attend_flash
        if k.q8 and path in ("direct", "table"):
            raise E.ArenaError(f"layer {layer}: q8_0 rows are read by attend_flash only, not the {path} path")
        if k.q8 and not self.shapes.flash_fits(layer):
            raise E.ArenaError(f"layer {layer}: attention over q8_0 rows runs attend_flash only, which needs at most "
                               f"{FLASH_MAX_GROUP} query heads per KV head and head_dim a multiple of 32")
        fits = self.shapes.flash_fits
        if k.key_rope is not None:  # turned per token: the table path's q·atom table cannot
            if path not in (None, "direct", "flash") or (path == "flash" and not fits(layer)):
                raise E.ArenaError(f"layer {layer}: keys coded before RoPE are attended by attend_direct or "
                                   f"attend_flash_coded's K_ROPE build (both streams coded, their atoms in one "
                                   f"format), which turn each decoded key to its position (or read out: "
                                   f"Attention.attend_reconstructed); not by the {path} path here")
            path = path or ("flash" if self.grid.local == GPU_LOCAL and fits(layer) else "direct")
        if path == "flash" or (path is None and (self.grid.local == GPU_LOCAL or k.q8) and fits(layer)):
            return self.flash_plan(layer, n_used)
        p = P.plan(k, v, self.layout.head_dim, self.grid.hb, self.layout.n_atoms, n_used, n_cached,
                   self.grid.preferred_splits, "direct" if windowed else path)
        if p.records > self.grid.max_splits:
            raise E.ArenaError(f"attention over {n_used} tokens needs {p.records} splits, this engine holds "
                               f"{self.grid.max_splits}")
        return p

    def variant(self, layer: int, plan: P.Plan) -> str:
        """The SPIR-V variant that runs ``plan`` over ``layer`` (its main pass: what
        kvdict-validate lists and benchmark rows name)."""
        return self.passes.variant(layer, plan)

    def flash_plan(self, layer: int, n_used: int, seqs: int = 1) -> P.Plan:
        """The flash kernel's plan (FlashShapes.plan): its launch shape timed on the device
        (time_plan) where the engine tunes and the device has timestamps."""
        if not self.shapes.flash_fits(layer):
            raise E.ArenaError(f"layer {layer}: no flash kernel fits it (attend_flash: an uncoded layer, at most "
                               f"{FLASH_MAX_GROUP} query heads per KV head, head_dim a multiple of 8 (f16, f32) or "
                               f"32 (q8_0); attend_flash_coded: both streams dict-coded, head_dim a multiple of 4, "
                               f"the q·atom table in shared memory)")
        timer = self.time_plan if self.times_plans else None
        return self.shapes.plan(layer, n_used, seqs, timer)

    @property
    def times_plans(self) -> bool:
        """Whether flash_plan times launch shapes on the device (the engine tunes and the device
        has timestamps)."""
        return self.tune and timestamps_usable(self.device)

    def time_plan(self, layer: int, n_used: int, plan: P.Plan) -> float | None:
        """GPU seconds of one attention over ``layer`` in ``plan`` (the best of a few runs;
        whatever query the buffer holds — the time does not depend on its values — with
        every sequence's n_used set to ``n_used``: the flash kernels read those)."""
        ops = self.passes.ops(layer, plan, n_used, n_used, 1.0 / float(np.sqrt(self.layout.head_dim)))
        self.buffers.upload_lengths([n_used] * plan.seqs)  # the flash kernels read each sequence's n_used
        rec = self._recording(ops, True, T.FLUSH_BYTES, f"timing a plan of layer {layer}")
        try:
            times = []
            for _ in range(T.REPEATS):
                rec.run()
                times.append(rec.core_seconds())
            return None if None in times else min(times)
        finally:
            rec.free()

    def flush_ops(self, n_bytes: int) -> list:
        """An L2 flush to record ahead of timed passes (AttendBuffers.flush_ops)."""
        return self.buffers.flush_ops(n_bytes)

    def splits(self, n_used: int, layer: int | None) -> tuple[int, int]:
        """(splits per KV head, tokens per split) of an attention over n_used cached tokens."""
        p = self.plan(0 if layer is None else layer, n_used)
        return p.n_splits, p.split_len

    def max_fresh_tokens(self, layer: int) -> int:
        """The most new tokens a step attends over from the upload buffer in one split."""
        k, v = self.layout.layers[layer].streams
        return P.max_split_tokens("direct", k.sparsity if k.coded else 0, v.sparsity if v.coded else 0)

    # --- running --------------------------------------------------------------------------------------
    def _eval(self, ops, what: str, seqs: int = 0) -> np.ndarray:
        """The query's upload, ``ops`` and the read-back of the output in one submission
        (``seqs``: as output's)."""
        b = self.buffers
        self.memory.check_live()
        b.clear_bins()
        b.bins_clear = False
        self.device.submit(self.passes.q_upload(b.q), *ops, self.passes.read_back(b.out), what=what)
        b.bins_clear = True
        return self.output(seqs)

    def output(self, seqs: int = 0) -> np.ndarray:
        """The last attention's output, (n_heads, head_dim) float32 — or, ``seqs`` > 0 (a
        batched attention's), (seqs, n_heads, head_dim)."""
        return self.buffers.output(seqs)

    def recording(self, layer: int, q: np.ndarray, n_used: int, scale: float | None = None,
                  path: str | None = None, timestamps: bool | str = False, flush_bytes: int = 0,
                  primed: bool = False) -> Recording:
        """One attention over tokens [0, n_used) of ``layer`` recorded once (query upload,
        passes, read-back), for benchmarks: every run() repeats exactly that attention —
        the query is uploaded here, and each run copies it to the device again. The atom
        weights the table path needs cleared are cleared by every completed run.
        ``flush_bytes``: an L2 flush of that many bytes right before the timed passes, in the
        same submission (flush_ops), so they start on a busy GPU, as queued work does.
        ``primed``: the passes run once more ahead of those (and of the flush), untimed — the
        timed ones then are not their pipelines' first dispatch in the submission, as a
        layer's attention is not in a decode step recorded whole (an NVIDIA H200 spends
        ~6 µs more on that first one, even behind other work: docs/DESIGN.md)."""
        q, n_used, scale = check_query(self.layout, q, n_used, self.memory.n_tokens(layer), scale)
        self._warm(layer, n_used, scale)
        self.buffers.clear_bins()
        ops = self.passes.ops(layer, self.plan(layer, n_used, path=path), n_used, n_used, scale)
        self.buffers.upload_query(q, n_used)
        return self._recording(ops, timestamps, flush_bytes, f"attention over layer {layer}", primed)

    def barrier_op(self):
        """A compute→compute barrier on every buffer this engine owns: what is recorded after it
        sees everything its passes wrote (an attention recorded after another in one submission)."""
        return self.passes.sync(*self.buffers.owned)

    def _recording(self, ops: list, timestamps, flush_bytes: int, what: str, primed: bool = False) -> Recording:
        """The query's copy up, [``ops`` and a barrier on everything they write, if primed,]
        [the flush,] ``ops`` (the core), the output's read-back; what comes between the copy
        and the core is left out of gpu_seconds (untimed). A completed attention leaves
        its scratch as the next one expects it (the atom weights zero), so ``ops`` may run
        twice in one submission."""
        ahead = [*ops, self.barrier_op()] if primed else []
        ahead += self.flush_ops(flush_bytes)
        first = len(ahead) + 1
        return Recording(self.device, [self.passes.q_upload(self.q), *ahead, *ops, self.passes.read_back(self.out)],
                         timestamps=timestamps, what=what, core=(first, first + len(ops)), untimed=(1, first))

    def _warm(self, layer: int, n_used: int, scale: float) -> None:
        """On a layer's first attention, make every pipeline its plans may use (the direct
        pass alone and with the merge; the table passes of a coded layer): the plan changes
        as the context grows, and compiling a pipeline mid-decode stalls that token (~80 ms
        per pipeline and layer on llvmpipe — seconds per plan change for a 30-layer model)."""
        if layer in self._warm_layers:
            return
        k, v = self.layout.layers[layer].streams
        if k.kivi:  # attend_flash_kivi's one pipeline (and the merge's)
            self.passes.ops(layer, self.plan(layer, n_used), n_used, n_used, scale)
            self._warm_layers.add(layer)
            return
        plans = []
        if not k.q8:  # attend_direct reads f16 / f32 rows and slots only
            plans.append(P.Plan("direct", 1, n_used))
            if self.grid.max_splits >= 2:
                plans.append(P.Plan("direct", 2, -(-n_used // 2)))
        if (k.coded or v.coded) and not self.layout.layers[layer].windowed:
            plans.append(P.Plan("table", 1, n_used))
        plannable = self.grid.local == GPU_LOCAL or self.path == "flash" or k.q8  # the flash kernels planned there
        if self.shapes.flash_fits(layer) and plannable:
            plans.append(P.Plan("flash", 1, n_used))
        for p in plans:  # the operations are recorded later, if ever; only the pipelines stay
            self.passes.ops(layer, p, n_used, n_used, scale)
        self._warm_layers.add(layer)

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float) -> np.ndarray:
        ll = self.layout.layers[layer]
        if ll.windowed and (self.path == "rows" or not (ll.k.windowed and ll.v.windowed)):
            return self.attend_reconstructed(layer, q, n_used, scale)
        if ll.k.kivi and self.path in ("direct", "table", "rows"):
            return self.attend_reconstructed(layer, q, n_used, scale)  # the read-out path (the fallback)
        self._warm(layer, n_used, scale)
        ops = self.passes.ops(layer, self.plan(layer, n_used), n_used, n_used, scale)
        self.buffers.upload_query(q, n_used)
        return self._eval(ops, f"attending over layer {layer}")

    def step(self, layer: int, q: np.ndarray, n_cached: int, n_new: int, scale: float, scatter_ops,
             fresh_words: tuple[int, int]) -> np.ndarray:
        """Attention over n_cached cached + n_new fresh tokens, whose rows are in the arena's
        upload buffer at fresh_words = (K word, V word); ``scatter_ops`` (copying them into
        the layer) go first in the same submission."""
        n_used = n_cached + n_new
        self._warm(layer, n_used, scale)
        ops = self.passes.ops(layer, self.plan(layer, n_used, n_cached), n_used, n_cached, scale, fresh_words)
        self.buffers.upload_query(q, n_used)
        return self._eval([*scatter_ops, *ops], f"decode step on layer {layer}")

    def attend_batch(self, layer: int, q: np.ndarray, n_used: list[int], scale: float) -> np.ndarray:
        """Batched decode attention (KvArena.attend_batch: arguments checked there): sequence
        b's query heads q[b] over its first n_used[b] tokens, every sequence in the same
        flash dispatches. Returns (seqs, n_heads, head_dim) float32."""
        if self.layout.layers[layer].windowed:  # an arena of one sequence (KvArena refuses more)
            return self.attend(layer, q[0], n_used[0], scale)[None]
        ops = self._batch_ops(layer, len(n_used), max(n_used), scale)
        self.buffers.upload_query(q, n_used)
        return self._eval(ops, f"batched attention over layer {layer}", seqs=len(n_used))

    def batch_recording(self, layer: int, q: np.ndarray, n_used: list[int], scale: float,
                        timestamps: bool | str = False, flush_bytes: int = 0, primed: bool = False) -> Recording:
        """attend_batch recorded once (query upload, passes, read-back), for benchmarks;
        ``flush_bytes`` and ``primed`` as for :meth:`recording`."""
        ops = self._batch_ops(layer, len(n_used), max(n_used), scale)
        self.buffers.upload_query(q, n_used)
        return self._recording(ops, timestamps, flush_bytes, f"batched attention over layer {layer}", primed)

    def _batch_ops(self, layer: int, seqs: int, n_max: int, scale: float) -> list:
        if not 1 <= seqs <= self.seqs:
            raise E.ArenaError(f"a batch of {seqs} sequences; this arena holds {self.seqs}")
        return self.passes.ops(layer, self.plan(layer, n_max, seqs=seqs), n_max, n_max, scale)

    def attend_reconstructed(self, layer: int, q: np.ndarray, n_used: int, scale: float) -> np.ndarray:
        """Reconstruct-then-attend (the KIVI cache's read-out path — ``path`` "rows", the
        fallback of attend_flash_kivi; a windowed dictionary layer's path; a benchmark
        baseline for the dict-coded one): reconstruct K and V of [0, n_used) on the GPU into an f32 buffer
        (one submission), then attention over those rows (a second submission: the rows are
        far too large for the barrier-by-copy) — attend_flash where it plans the flash
        kernels (GPUs, or ``path`` "flash"; its default launch shape, untuned), else
        attend_direct."""
        lay = self.layout
        rows = self.buffers.reconstructed(2 * lay.n_kv_heads * lay.n_ctx * lay.head_dim)
        plan = self.passes.reconstruct_plan(layer, n_used, rows)
        plan.dispatch()
        ops = self.passes.rows_ops(rows, self.rows_plan(n_used), n_used, scale)
        self.buffers.upload_query(q, n_used)
        return self._eval(ops, f"attending over reconstructed layer {layer}")

    def rows_plan(self, n_used: int) -> P.Plan:
        """The plan of an attention over n_used reconstructed f32 rows (attend_reconstructed)."""
        sh = self.shapes
        locals_ = sh.flash_locals_of("f32")
        if locals_ and self.path != "direct" and (self.grid.local == GPU_LOCAL or self.path == "flash"):
            shape = T.Shape(locals_[0], sh.flash_workgroups or T.workgroup_counts(sh.compute_units, False)[0])
            return sh.flash_shaped(n_used, shape)
        return P.Plan("direct", *P.split_count(n_used, self.grid.preferred_splits, P.MIN_DIRECT_SPLIT_TOKENS,
                                               P.max_split_tokens("direct", 0, 0)))

    def free(self) -> None:
        if self.passes is not None:
            self.passes.free()
        self.buffers.free()  # the L2 flush's scratch, then the rest


def check_query(layout, q, n_used, n_tokens: int, scale) -> tuple[np.ndarray, int, float]:
    """Validate KvArena.attend's arguments; returns (q, n_used, scale) normalised."""
    hd, n_kv = layout.head_dim, layout.n_kv_heads
    if not isinstance(q, np.ndarray) or q.dtype != np.float32:
        raise E.ShapeError(f"attend: q must be a float32 numpy array, got "
                           f"{getattr(q, 'dtype', type(q).__name__)}")
    if q.ndim != 2 or q.shape[1] != hd or q.shape[0] < 1 or q.shape[0] % n_kv:
        raise E.ShapeError(f"attend: q shape {q.shape}, expected (n_heads, {hd}) with n_heads a "
                           f"multiple of n_kv_heads {n_kv}")
    if isinstance(n_used, (bool, np.bool_)) or not isinstance(n_used, (int, np.integer)):
        raise E.ArenaError(f"attend: n_used must be an integer, got {n_used!r}")
    if not 1 <= n_used <= n_tokens:
        raise E.ArenaError(f"attend: n_used {n_used} outside 1..{n_tokens} (the tokens appended to this layer)")
    return q, int(n_used), check_scale(scale, hd)


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(scale)):
        raise E.ShapeError(f"attend: scale must be a finite number, got {scale!r}")
    return float(scale)
