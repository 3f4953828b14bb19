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
record (attend_common.glsl) that the last passes merge.

Between dependent dispatches of one submission we record a compute→compute barrier on
the buffers just written (kvdict_vk.vk.kernels.barrier: Kompute's OpMemoryBarrier, which
scripts/setup.sh binds for Python). A step's new tokens are read from the upload buffer
(attend_direct's fresh rows) rather than from the layer the step's scatter writes them
into, so no dispatch of a step waits on the scatter.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ... import errors as E
from . import plan as P
from .plan import LOOP_BUDGET, loop_iterations  # noqa: F401 (re-exported: tests, tools)
from .ops import PassBuilder
from .specs import (FLASH_END_ELEMS, FLASH_FLOAT_END_ELEMS, FLASH_MAX_GROUP, Sizes, flash_coded_bucket, flash_round_tokens, flash_shared_bytes, flash_subgroup_fits, flash_units, lengths_word)
from .tune import FLASH_CODED_LOCALS, FLASH_LOCALS  # the launch sizes live with the tuner
from ..device import kp
from ..kernels import Buffer, Kernel, barrier
from . import tune as T
from ..submit import Recording, timestamps_usable

MAX_SPLITS = 128  # per KV head
CPU_SIMD_LANES = 8  # 32-bit lanes of llvmpipe's 256-bit vectors: the workgroup size on CPU drivers
SPLIT_LANES_PER_CPU = 8  # CPU drivers: splits (over all KV heads) per hardware thread
GPU_LOCAL = 64
HEAD_BLOCK_FLOATS = 192  # query (and accumulator) floats an invocation keeps for its block of heads
BINS_BUDGET_WORDS = 1 << 24  # the atom weights of all splits: at most 64 MiB
PATHS = (None, "direct", "table", "flash")
FLASH_MIN_SPLIT_TOKENS = 128  # attend_flash: a split's fixed costs (queries, record, merge) stay small
# attend_flash_coded: each workgroup loads its heads' q·atom table and multiplies its atom
# weights by every atom at the end (n_atoms × head_dim words from the L2): splits stay long
# (and few: attend_tune.workgroup_counts)
FLASH_CODED_MIN_SPLIT_TOKENS = 512
# The kernels over the codes, the untuned default first (the tuner times each): "float"
# (attend_flash_coded). Its fixed-point sibling lost everywhere on an H200 once the float
# kernel's atom weights became owned (docs/DESIGN.md) and went; a kernel over the codes for
# another device class would join here.
CODED_KERNELS = ("float",)
# attend_flash's builds, the untuned default first: "float" (attend_flash: the split's end 2
# elements of a unit a pass through shared memory, attend_specs.FLASH_FLOAT_END_ELEMS) and
# "wide_end" (attend_flash_wide: the end in a few barriers). The wide end is shorter, but its
# registers halve the token loop's occupancy on an H200, up to a third slower at long contexts
# (docs/DESIGN.md): the tuner times both.
FLASH_KERNELS = ("float", "wide_end")


def head_block(group: int, head_dim: int) -> int:
    """Query heads per invocation: the largest divisor of the group whose query and
    accumulator state (HB × head_dim floats each) stays within HEAD_BLOCK_FLOATS — more
    heads per invocation share each loaded key/value, but llvmpipe's compile time grows
    quickly with private state (attend_common.glsl)."""
    return max(d for d in range(1, group + 1) if group % d == 0 and (d == 1 or d * head_dim <= HEAD_BLOCK_FLOATS))


class Attention:
    """Decode attention for one arena and one query-head count (buffers and pipelines
    are made on first use and kept until the arena is freed)."""

    def __init__(self, arena, n_heads: int):
        lay = arena.layout
        if lay.head_dim % 4:
            raise E.ArenaError(f"GPU attention needs head_dim % 4 == 0 (vec4 rows), got {lay.head_dim}")
        if lay.mode == "f16" and lay.head_dim % 8:
            raise E.ArenaError(f"GPU attention over an f16 cache needs head_dim % 8 == 0 (a vec4 of words "
                               f"is 8 halves), got {lay.head_dim}")
        self.arena, self.device, self.layout = arena, arena.device, lay
        self.n_heads, self.group = n_heads, n_heads // lay.n_kv_heads
        self.hb = head_block(self.group, lay.head_dim)
        n_kv, hd, g = lay.n_kv_heads, lay.head_dim, self.group
        self.units = n_kv * (g // self.hb)  # (KV head, head block) pairs
        self.path = None  # None: the cost model chooses; "direct" / "table" forces a path
        # attend_flash_coded's workgroups per attention (splits × KV heads × head blocks), the
        # aim of its split count (None: measured on a GPU among attend_tune.workgroup_counts, the
        # first of them on a CPU driver); attend_flash's likewise. Benchmarks fix them to sweep them.
        self.coded_workgroups: int | None = None
        self.flash_workgroups: int | None = None
        # attend_flash_coded's query heads per workgroup (None: measured with the launch
        # shape on a GPU; the most that fit on a CPU driver). Tests and benchmarks fix it.
        self.coded_heads: int | None = None
        # the kernel over the codes (CODED_KERNELS; None: measured with the launch shape on a
        # GPU, the first on a CPU driver). Tests and benchmarks fix it.
        self.coded_kernel: str | None = None
        # attend_flash's build (FLASH_KERNELS; None: measured with the launch shape on a GPU,
        # the first on a CPU driver). Tests and benchmarks fix it.
        self.flash_kernel: str | None = None
        # whether attend_flash sums a token's partial scores by subgroup shuffles
        # (attend_flash_sg) — None: wherever the device has them and they fit the row
        # (flash_variant); False: through shared memory everywhere. Tests fix it.
        self.subgroups: bool | None = None
        self._flush: dict = {}  # words read → (kernel, source, sink): flush_ops' L2 flushes
        self.any_k_coded = any(ll.k.coded for ll in lay.layers)
        self.any_v_coded = any(ll.v.coded for ll in lay.layers)
        # The arena's shader mapping says which machine to plan for: "row" (CPU drivers:
        # a workgroup per SIMD row, a few splits per thread) or "chunk" (GPUs).
        cpu = arena.shader_mapping == "row"
        self.tune = not cpu  # measure the flash kernels' launch shape (attend_tune)
        # the candidate workgroup counts (attend_tune.workgroup_counts: from the multiprocessors
        # the device reports); tests fix the count to plan as on another GPU
        self.compute_units = self.device.limit("compute_units") or 0
        self.local = CPU_SIMD_LANES if cpu else GPU_LOCAL
        # Preferred splits per KV head: enough to give every hardware thread a full SIMD row
        # (CPU drivers) or to fill a GPU. Capacity (records per KV head): what any plan of
        # the longest context needs; the atom weights' memory caps it.
        want = SPLIT_LANES_PER_CPU * (os.cpu_count() or 2) if cpu else 1024
        self.preferred_splits = max(1, min(MAX_SPLITS, -(-want // self.units)))
        # a batched arena: arena.seqs sequences of arena.seq_ctx tokens each (n_ctx rows per head in all)
        self.seqs, seq_ctx = arena.seqs, arena.seq_ctx
        needed = max(P.max_records(ll.k, ll.v, seq_ctx, self.preferred_splits) for ll in lay.layers)
        if not cpu:  # attend_flash's splits: its most workgroups over the KV heads
            needed = max(needed, min(MAX_SPLITS, max(T.workgroup_counts(self.compute_units, False)) // n_kv))
        if needed > MAX_SPLITS + 1:
            raise E.ArenaTooLargeError(f"attention over {seq_ctx} tokens needs {needed} splits per KV head "
                                       f"(at most {MAX_SPLITS}); use a shorter context or a lower sparsity")
        self.max_splits = needed
        if self.any_v_coded:
            per_split = n_kv * g * lay.n_atoms
            cap = min(BINS_BUDGET_WORDS, self.device.limit("max_storage_buffer_range") // 4) // per_split
            if cap < needed:
                raise E.ArenaTooLargeError(f"{self.device.name}: the atom weights of {needed} splits "
                                           f"({needed * per_split} words) exceed the budget")
        self.sizes = sz = Sizes(n_kv, g, hd, max(lay.n_atoms, 1), seq_ctx, self.max_splits, self.seqs)
        self._buffers: list[Buffer] = []
        self._recon = None
        self._warm_layers: set[int] = set()
        # (what, layer) → a fact of the layer that planning reads on every step (the flash
        # kernels' workgroup sizes, whether one fits, the tuner's layer signature): they depend
        # on the layout, the group and the device's limits only, all fixed for the engine's
        # life, so they are derived once and never invalidated (_per_layer)
        self._layer_facts: dict[tuple, object] = {}
        self.passes = None
        try:
            new = self._new_buffer
            # device-local: on a discrete GPU a shader reading host-visible memory crosses
            # PCIe on every load; the query is copied up once per call instead (q_upload)
            self.q = new(sz.query, "device", "attention query")
            self.out = new(sz.out, "device", "attention output")
            self.stats = new(sz.stats, "device", "attention split stats")
            self.accs = new(sz.accs, "device", "attention split accumulators")
            self.dummy = new(4, "storage", "unused binding")
            coded = self.any_k_coded or self.any_v_coded
            self.table = new(sz.table, "device", "q·atom table") if self.any_k_coded else None
            self.scores = new(sz.scores, "storage", "attention scores") if coded else None
            self.bins = new(sz.bins, "device", "split atom weights") if self.any_v_coded else None
            self.blocks = new(sz.blocks, "device", "atom-weight products") if self.any_v_coded else None
            self._bins_clear = False
            self._clear_bins()
            self.passes = PassBuilder(self)
        except BaseException:
            self.free()
            raise

    def _clear_bins(self) -> None:
        """The split pass expects zero atom weights (attend_atoms.comp leaves them so after a
        completed attention): on creation, and after an attention that did not complete."""
        if self.bins is None or self._bins_clear:
            return
        self.bins.host_words()[:] = 0
        self.device.submit(kp.OpTensorSyncDevice([self.bins.tensor]), what="clearing the atom weights")
        self._bins_clear = True

    def _new_buffer(self, words: int, kind: str, name: str) -> Buffer:
        b = Buffer(self.device, words, kind, name)
        self._buffers.append(b)
        return b

    # --- planning ---------------------------------------------------------------------------------
    def max_local(self) -> int:
        """The largest one-dimensional workgroup the device allows: the lesser of
        maxComputeWorkGroupInvocations and maxComputeWorkGroupSize[0] (every workgroup size
        chosen here and in attend_ops keeps within it)."""
        return min(self.device.limit("max_compute_work_group_invocations"),
                   self.device.limit("max_compute_work_group_size")[0])

    def _per_layer(self, what: str, layer: int, derive):
        """``derive()``, once per (what, layer) (see _layer_facts)."""
        key = (what, layer)
        if key not in self._layer_facts:
            self._layer_facts[key] = derive()
        return self._layer_facts[key]

    def flash_fits(self, layer: int) -> bool:
        """Whether a flash kernel can attend over ``layer``: attend_flash_coded (both streams
        dict-coded; flash_coded_config) or attend_flash (both uncoded: flash_local)."""
        def derive() -> bool:
            k, v = self.layout.layers[layer].streams
            if k.coded and v.coded:
                return self.flash_coded_heads(layer) > 0
            if k.coded or v.coded or k.rows != v.rows:
                return False
            return self.flash_local(layer) > 0
        return self._per_layer("flash_fits", layer, derive)

    def layer_signature(self, layer: int) -> tuple:
        """attend_tune's signature of ``layer`` (what its launch shape depends on besides the context)."""
        return self._per_layer("signature", layer, lambda: T.layer_signature(self, layer))

    def flash_locals(self, layer: int) -> list[int]:
        """attend_flash's workgroup sizes over an uncoded ``layer``, preferred first (empty: it
        cannot): at most FLASH_MAX_GROUP query heads per KV head, head_dim a multiple of 8
        (a unit of 8 elements per invocation) or 32 (q8_0 blocks); those of FLASH_LOCALS
        (attend_tune) the device allows that the row's units divide and where the untuned build,
        FLASH_KERNELS[0], fits (flash_end_elems: its split end's shared memory)."""
        k = self.layout.layers[layer].k
        return [] if k.coded else self.flash_locals_of(k.rows)

    def flash_locals_of(self, rows: str) -> list[int]:
        """attend_flash's workgroup sizes over ``rows`` ("f16", "f32", "q8_0"), preferred
        first (flash_locals; the reconstruct-then-attend path asks for "f32")."""
        def derive() -> tuple[int, ...]:
            hd = self.layout.head_dim
            if self.group > FLASH_MAX_GROUP or hd % (32 if rows == "q8_0" else 8):
                return ()
            most, units = self.max_local(), flash_units(hd)
            return tuple(n for n in FLASH_LOCALS if n <= most and n % units == 0
                         and self.flash_end_elems(n, FLASH_KERNELS[0]))
        return list(self._per_layer("flash_locals_of", rows, derive))  # per row format

    def flash_end_elems(self, local: int, kernel: str) -> int:
        """END_ELEMS of attend_flash's build ``kernel`` (FLASH_KERNELS) at ``local`` invocations:
        the elements of a unit its split's end moves through shared memory per pass — the float
        builds' FLASH_FLOAT_END_ELEMS, the wide end's the most of FLASH_END_ELEMS — where the
        device's shared memory holds them; 0 where it does not (then the build is no candidate)."""
        if kernel not in FLASH_KERNELS:
            raise E.ArenaError(f"Attention.flash_kernel must be None or one of {FLASH_KERNELS}, got {kernel!r}")

        def derive() -> int:
            limit, units = self.device.limit("max_compute_shared_memory_size"), flash_units(self.layout.head_dim)
            wide = kernel == "wide_end"
            offered = FLASH_END_ELEMS if wide else (FLASH_FLOAT_END_ELEMS[kernel],)
            return next((e for e in offered if flash_shared_bytes(self.group, local, units, e, wide) <= limit), 0)
        offers = (FLASH_END_ELEMS, tuple(FLASH_FLOAT_END_ELEMS.items()))  # tests replace them
        return self._per_layer("flash_end_elems", (local, kernel) + offers, derive)

    def flash_kernel_locals(self, layer: int, kernel: str) -> list[int]:
        """attend_flash's workgroup sizes over an uncoded ``layer`` for build ``kernel``
        (FLASH_KERNELS): those of flash_locals whose split end fits (flash_end_elems)."""
        return [n for n in self.flash_locals(layer) if self.flash_end_elems(n, kernel)]

    def flash_variant(self, local: int, shader: str = "attend_flash") -> str:
        """The SPIR-V of ``shader`` — attend_flash or its wide end, spreading a token over
        flash_units(head_dim) invocations — at ``local`` invocations: its _sg
        build where the device's subgroups can sum a token's partial scores
        (attend_specs.flash_subgroup_fits) and ``subgroups`` allows, else the plain one
        (shared memory, no optional feature). Derived once per (shader, size, setting):
        planning asks on every step."""
        def derive() -> str:
            fits = flash_subgroup_fits(flash_units(self.layout.head_dim), local, self.device.shuffle_subgroup_size())
            return f"{shader}_sg" if fits and self.subgroups is not False else shader
        return self._per_layer("flash_variant", (shader, local, self.subgroups), derive)

    def flash_local(self, layer: int) -> int:
        """attend_flash's default workgroup over an uncoded ``layer`` (0: it cannot)."""
        return (self.flash_locals(layer) or [0])[0]

    def flash_coded_options(self, layer: int, kernel: str = "float") -> list[tuple[int, list[int]]]:
        """[(query heads per workgroup, workgroup sizes preferred first)] of the coded flash
        ``kernel`` (CODED_KERNELS) over ``layer``, most heads first (empty: it cannot): every
        divisor of the group up to FLASH_MAX_GROUP at which attend_flash_coded runs
        (attend_specs.flash_coded_bucket: the atoms it owns, a bucket in the shared memory left
        beside the q·atom table, …) with some size of FLASH_CODED_LOCALS (attend_tune) the
        device allows; with it, every such size. The tuner times them all; untuned, the first
        (the most heads: each slot loaded serves them all)."""
        if kernel not in CODED_KERNELS:
            raise E.ArenaError(f"the kernel over the codes is one of {CODED_KERNELS}, got {kernel!r}")

        def derive() -> tuple[tuple[int, tuple[int, ...]], ...]:
            k, v = self.layout.layers[layer].streams
            if not (k.coded and v.coded) or self.layout.head_dim % 4:
                return ()
            most = self.max_local()
            out = []
            for hb in sorted((d for d in range(1, min(self.group, FLASH_MAX_GROUP) + 1) if self.group % d == 0),
                             reverse=True):
                sizes = tuple(n for n in FLASH_CODED_LOCALS if n <= most and self.flash_coded_bucket(layer, hb, n))
                if sizes:
                    out.append((hb, sizes))
            return tuple(out)
        return [(hb, list(sizes)) for hb, sizes in self._per_layer("flash_coded_options", (layer, kernel), derive)]

    def flash_coded_bucket(self, layer: int, hb: int, local: int) -> int:
        """attend_flash_coded's BUCKET over ``layer`` at ``hb`` query heads and ``local``
        invocations (attend_specs.flash_coded_bucket within the device's shared memory), derived
        once: every coded attention's passes ask."""
        def derive() -> int:
            v = self.layout.layers[layer].v
            return flash_coded_bucket(self.layout.head_dim, hb, local, self.layout.n_atoms, v.sparsity,
                                      v.residual_bits, self.device.limit("max_compute_shared_memory_size"))
        return self._per_layer("flash_coded_bucket", (layer, hb, local), derive)

    def flash_coded_locals(self, layer: int) -> tuple[int, list[int]]:
        """The default of flash_coded_options: (query heads per workgroup, workgroup sizes)
        ((0, []): attend_flash_coded cannot attend over ``layer``)."""
        return (self.flash_coded_options(layer) or [(0, [])])[0]

    def flash_coded_config(self, layer: int) -> tuple[int, int]:
        """(query heads, default invocations) per workgroup of attend_flash_coded ((0, 0): it cannot)."""
        hb, fits = self.flash_coded_locals(layer)
        return hb, (fits or [0])[0]

    def flash_coded_heads(self, layer: int) -> int:
        """Query heads per workgroup of attend_flash_coded over ``layer`` (0: it cannot)."""
        return self.flash_coded_config(layer)[0]

    def plan(self, layer: int, n_used: int, n_cached: int | None = None, path: str | None = None,
             seqs: int = 1) -> P.Plan:
        """How an attention over tokens [0, n_used) of ``layer`` runs, n_cached of them
        (default: all) in the cache and the rest fresh (a step's new tokens); ``path``
        (default: ``self.path``) forces "direct" or "table". ``seqs`` > 1: a batched
        attention of that many sequences, n_used the longest (the flash kernels only)."""
        path = self.path if path is None else path
        if seqs > 1:
            if path not in (None, "flash") or not self.flash_fits(layer):
                raise E.ArenaError(f"layer {layer}: batched attention runs the flash kernels only, which "
                                   f"{'were not asked for' if path not in (None, 'flash') else 'do not fit it'}")
            return self._flash_plan(layer, n_used, seqs)
        if path not in PATHS:
            raise E.ArenaError(f"Attention.path must be one of {PATHS}, got {path!r}")
        k, v = self.layout.layers[layer].streams
        if k.kivi:
            raise E.ArenaError(f"layer {layer}: a KIVI layer is attended by reconstruct-then-attend "
                               f"(Attention.attend does it); no kernel path reads its words in place")
        n_cached = n_used if n_cached is None else n_cached
        # GPUs: the flash kernels (a workgroup per split and KV head) over uncoded rows and
        # over layers whose streams are both coded; CPU drivers keep attend_direct and the
        # table path, shaped for them (attend_common.glsl says why); q8_0 rows: attend_flash
        if k.q8 and path in ("direct", "table"):
            raise E.ArenaError(f"layer {layer}: q8_0 rows are read by attend_flash only, not the {path} path")
        if k.q8 and not self.flash_fits(layer):
            raise E.ArenaError(f"layer {layer}: attention over q8_0 rows runs attend_flash only, which needs at most "
                               f"{FLASH_MAX_GROUP} query heads per KV head and head_dim a multiple of 32")
        if path == "flash" or (path is None and (self.local == GPU_LOCAL or k.q8) and self.flash_fits(layer)):
            if not self.flash_fits(layer):
                raise E.ArenaError(f"layer {layer}: no flash kernel fits it (attend_flash: an uncoded layer, at most "
                                   f"{FLASH_MAX_GROUP} query heads per KV head, head_dim a multiple of 8 (f16, f32) or 32 (q8_0); "
                                   f"attend_flash_coded: both streams dict-coded, head_dim a multiple of 4, "
                                   f"the q·atom table in shared memory)")
            return self._flash_plan(layer, n_used)
        p = P.plan(k, v, self.layout.head_dim, self.hb, self.layout.n_atoms, n_used, n_cached,
                   self.preferred_splits, path)
        if p.records > self.max_splits:
            raise E.ArenaError(f"attention over {n_used} tokens needs {p.records} splits, this engine holds "
                               f"{self.max_splits}")
        return p

    def flash_candidates(self, layer: int, seqs: int = 1) -> list[T.Shape]:
        """The launch shapes of ``layer``'s flash kernel the tuner times, the untuned one first:
        every kernel build, query heads per workgroup (over the codes) and workgroup size the
        layer and device allow (or the attributes force), at every workgroup count of
        attend_tune.workgroup_counts — counts whose splits the cap makes equal (3 KV heads: 528
        and 1 056 workgroups both 128 splits) once. Derived once per setting of the attributes
        it reads: planning asks on every step."""
        def derive() -> tuple[T.Shape, ...]:
            shapes = []
            if self.layout.layers[layer].k.coded:
                if self.coded_kernel is not None and self.coded_kernel not in CODED_KERNELS:
                    raise E.ArenaError(f"Attention.coded_kernel must be None or one of {CODED_KERNELS}, "
                                       f"got {self.coded_kernel!r}")
                for kernel in CODED_KERNELS if self.coded_kernel is None else (self.coded_kernel,):
                    options = self.flash_coded_options(layer, kernel)
                    if self.coded_heads is not None:
                        options = [o for o in options if o[0] == self.coded_heads]
                    shapes += T.candidates(options, T.workgroup_counts(self.compute_units, True), kernel)
                if not shapes:
                    can = {kern: [hb for hb, _ in self.flash_coded_options(layer, kern)] for kern in CODED_KERNELS}
                    raise E.ArenaError(f"layer {layer}: no kernel over the codes ({self.coded_kernel or 'any'}) "
                                       f"serves {self.coded_heads or 'any number of'} query heads per workgroup "
                                       f"here (they can: {can})")
            else:
                for kernel in FLASH_KERNELS if self.flash_kernel is None else (self.flash_kernel,):
                    shapes += T.candidates([(0, self.flash_kernel_locals(layer, kernel))],
                                           T.workgroup_counts(self.compute_units, False), kernel)
                if not shapes:
                    raise E.ArenaError(f"layer {layer}: attend_flash ({self.flash_kernel}) has no workgroup size here")
            distinct = {}
            for sh in shapes:
                distinct.setdefault((sh.local, sh.heads, sh.kernel, self.splits_wanted(sh, seqs)), sh)
            return tuple(distinct.values())
        setting = (seqs, self.coded_kernel, self.coded_heads, self.flash_kernel, self.compute_units)
        return list(self._per_layer(("flash_candidates",) + setting, layer, derive))

    def _flash_plan(self, layer: int, n_used: int, seqs: int = 1) -> P.Plan:
        """The flash kernel's plan: a launch shape (workgroup size, workgroups) measured on
        the device (attend_tune) unless fixed by ``flash_workgroups`` / ``coded_workgroups``
        or on a CPU driver, and the splits that make that many workgroups."""
        coded = self.layout.layers[layer].k.coded
        shapes = self.flash_candidates(layer, seqs)
        fixed = self.coded_workgroups if coded else self.flash_workgroups

        def shaped(shape: T.Shape) -> P.Plan:
            return self.flash_shaped(n_used, shape, seqs)
        if fixed is None and self.tune and timestamps_usable(self.device):
            forced = tuple(x for x in (self.coded_heads, self.coded_kernel) if x is not None) if coded else \
                ((self.flash_kernel,) if self.flash_kernel is not None else ())
            forced += (("seqs", seqs),) if seqs > 1 else ()
            shape = T.choose(self.layer_signature(layer) + forced, n_used, shapes,
                             lambda sh: self.time_plan(layer, n_used, shaped(sh)))
        else:
            first = shapes[0]
            shape = T.Shape(first.local, fixed or first.workgroups, first.heads, first.kernel)
        return shaped(shape)

    def flash_shaped(self, n_used: int, shape: T.Shape, seqs: int = 1) -> P.Plan:
        """The flash plan of a launch shape (over the codes where ``shape.heads`` is set): the
        splits that make ``shape.workgroups`` workgroups over the KV heads (and head blocks) of
        ``seqs`` sequences, each at least FLASH_(CODED_)MIN_SPLIT_TOKENS long and a whole number
        of the kernel's rounds (attend_specs.flash_round_tokens)."""
        coded = shape.heads > 0
        rounds = flash_round_tokens(self.layout.head_dim, shape.local, coded)
        min_tokens = FLASH_CODED_MIN_SPLIT_TOKENS if coded else FLASH_MIN_SPLIT_TOKENS
        n, split_len = P.split_count(n_used, self.splits_wanted(shape, seqs), min_tokens, n_used, rounds)
        return P.Plan("flash", n, split_len, local=shape.local, heads=shape.heads, kernel=shape.kernel, seqs=seqs)

    def splits_wanted(self, shape: T.Shape, seqs: int = 1) -> int:
        """Splits per virtual head (sequence × KV head) that make at most ``shape.workgroups``
        workgroups over the virtual heads and head blocks — rounded down, so a count of whole
        waves stays whole (rounded up, 264 workgroups over 64 virtual heads became 320: a wave
        and a fifth, 25 % slower at B = 8 on an H200, docs/DESIGN.md) — within the capacity."""
        blocks = seqs * self.layout.n_kv_heads * (self.group // shape.heads if shape.heads else 1)
        return min(self.max_splits, max(1, shape.workgroups // blocks))

    def time_plan(self, layer: int, n_used: int, plan: P.Plan) -> float | None:
        """GPU seconds of one attention over ``layer`` in ``plan`` (the best of a few runs;
        whatever query the buffer holds — the time does not depend on its values — with
        every sequence's n_used set to ``n_used``: the flash kernels read those)."""
        ops = self.passes.ops(layer, plan, n_used, n_used, 1.0 / float(np.sqrt(self.layout.head_dim)))
        self._upload_lengths([n_used] * plan.seqs)  # the flash kernels read each sequence's n_used
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
        """An L2 flush to record ahead of timed passes (none for n_bytes 0): l2_flush reads
        n_bytes of a scratch buffer and writes nothing back, then a barrier, so the passes
        start on a busy GPU with whatever it pushed out of the L2 gone and no dirty lines left
        to write back (a copy leaves its destination's). Buffers are made once per size and
        kept until the engine is freed: recordings hold on to their ops."""
        words = n_bytes // 4 // 4 * 4  # whole vec4s
        if words <= 0:
            return []
        if words not in self._flush:
            src = Buffer(self.device, words, "storage", "L2 flush source")
            sink = Buffer(self.device, 4, "storage", "L2 flush sink")
            self._flush[words] = (Kernel(self.device, "l2_flush", [src, sink], max_items=words // 4), src, sink)
        kernel, _, sink = self._flush[words]
        return [kernel.op(n_words=words), barrier(sink)]

    def _free_flush(self) -> None:
        flushes, self._flush = self._flush, {}
        for kernel, src, sink in flushes.values():
            kernel.destroy()
            sink.destroy()
            src.destroy()

    def splits(self, n_used: int, layer: int | None) -> tuple[int, int]:
        """(splits per KV head, tokens per split) of an attention over n_used cached tokens."""
        p = self.plan(0 if layer is None else layer, n_used)
        return p.n_splits, p.split_len

    def max_fresh_tokens(self, layer: int) -> int:
        """The most new tokens a step attends over from the upload buffer in one split."""
        k, v = self.layout.layers[layer].streams
        return P.max_split_tokens("direct", k.sparsity if k.coded else 0, v.sparsity if v.coded else 0)

    # --- running --------------------------------------------------------------------------------------
    def _upload_q(self, q: np.ndarray, n_used) -> None:
        """The query block's host words: q (seqs × n_heads × head_dim floats), then each
        sequence's n_used (``n_used``: an int, or one per sequence; attend_common.glsl)."""
        words = np.ascontiguousarray(q, np.float32).reshape(-1).view(np.uint32)
        self.q.host_words()[:words.size] = words
        self._upload_lengths([n_used] if np.ndim(n_used) == 0 else n_used)

    def _upload_lengths(self, lengths) -> None:
        at = lengths_word(len(lengths), self.n_heads, self.layout.head_dim)
        self.q.host_words()[at:at + len(lengths)] = np.asarray(lengths, np.uint32)

    def _eval(self, ops, what: str, seqs: int = 0) -> np.ndarray:
        """The query's upload, ``ops`` and the read-back of the output in one submission
        (``seqs``: as output's)."""
        self.arena.check_live()
        self._clear_bins()
        self._bins_clear = False
        self.device.submit(self.passes.q_upload(self.q), *ops, self.passes.read_back(self.out), what=what)
        self._bins_clear = True
        return self.output(seqs)

    def output(self, seqs: int = 0) -> np.ndarray:
        """The last attention's output, (n_heads, head_dim) float32 — or, ``seqs`` > 0 (a
        batched attention's), (seqs, n_heads, head_dim)."""
        shape = (max(seqs, 1), self.n_heads, self.layout.head_dim)
        words = self.out.host_words()[:int(np.prod(shape))]
        out = words.view(np.float32).reshape(shape).copy()
        return out if seqs else out[0]

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
        q, n_used, scale = check_query(self.layout, q, n_used, self.arena.n_tokens(layer), scale)
        self._warm(layer, n_used, scale)
        self._clear_bins()
        ops = self.passes.ops(layer, self.plan(layer, n_used, path=path), n_used, n_used, scale)
        self._upload_q(q, n_used)
        return self._recording(ops, timestamps, flush_bytes, f"attention over layer {layer}", primed)

    def barrier_op(self):
        """A compute→compute barrier on every buffer this engine owns: what is recorded after it
        sees everything its passes wrote (an attention recorded after another in one submission)."""
        return self.passes.sync(*self._buffers)

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
        plans = []
        if not k.q8:  # attend_direct reads f16 / f32 rows and slots only
            plans.append(P.Plan("direct", 1, n_used))
            if self.max_splits >= 2:
                plans.append(P.Plan("direct", 2, -(-n_used // 2)))
        if k.coded or v.coded:
            plans.append(P.Plan("table", 1, n_used))
        if self.flash_fits(layer) and (self.local == GPU_LOCAL or self.path == "flash" or k.q8):  # plannable there
            plans.append(P.Plan("flash", 1, n_used))
        for p in plans:  # the operations are recorded later, if ever; only the pipelines stay
            self.passes.ops(layer, p, n_used, n_used, scale)
        self._warm_layers.add(layer)

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float) -> np.ndarray:
        if self.layout.layers[layer].k.kivi:  # no kernel reads KIVI words in place (yet)
            return self.attend_reconstructed(layer, q, n_used, scale)
        self._warm(layer, n_used, scale)
        ops = self.passes.ops(layer, self.plan(layer, n_used), n_used, n_used, scale)
        self._upload_q(q, n_used)
        return self._eval(ops, f"attending over layer {layer}")

    def step(self, layer: int, q: np.ndarray, n_cached: int, n_new: int, scale: float, scatter_ops,
             fresh_words: tuple[int, int]) -> np.ndarray:
        """Attention over n_cached cached + n_new fresh tokens, whose rows are in the arena's
        upload buffer at fresh_words = (K word, V word); ``scatter_ops`` (copying them into
        the layer) go first in the same submission."""
        n_used = n_cached + n_new
        self._warm(layer, n_used, scale)
        ops = self.passes.ops(layer, self.plan(layer, n_used, n_cached), n_used, n_cached, scale, fresh_words)
        self._upload_q(q, n_used)
        return self._eval([*scatter_ops, *ops], f"decode step on layer {layer}")

    def attend_batch(self, layer: int, q: np.ndarray, n_used: list[int], scale: float) -> np.ndarray:
        """Batched decode attention (KvArena.attend_batch: arguments checked there): sequence
        b's query heads q[b] over its first n_used[b] tokens, every sequence in the same
        flash dispatches. Returns (seqs, n_heads, head_dim) float32."""
        ops = self._batch_ops(layer, len(n_used), max(n_used), scale)
        self._upload_q(q, n_used)
        return self._eval(ops, f"batched attention over layer {layer}", seqs=len(n_used))

    def batch_recording(self, layer: int, q: np.ndarray, n_used: list[int], scale: float,
                        timestamps: bool | str = False, flush_bytes: int = 0, primed: bool = False) -> Recording:
        """attend_batch recorded once (query upload, passes, read-back), for benchmarks;
        ``flush_bytes`` and ``primed`` as for :meth:`recording`."""
        ops = self._batch_ops(layer, len(n_used), max(n_used), scale)
        self._upload_q(q, n_used)
        return self._recording(ops, timestamps, flush_bytes, f"batched attention over layer {layer}", primed)

    def _batch_ops(self, layer: int, seqs: int, n_max: int, scale: float) -> list:
        if not 1 <= seqs <= self.seqs:
            raise E.ArenaError(f"a batch of {seqs} sequences; this arena holds {self.seqs}")
        return self.passes.ops(layer, self.plan(layer, n_max, seqs=seqs), n_max, n_max, scale)

    def attend_reconstructed(self, layer: int, q: np.ndarray, n_used: int, scale: float) -> np.ndarray:
        """Reconstruct-then-attend (the KIVI cache's attention; a benchmark baseline for the
        dict-coded one): reconstruct K and V of [0, n_used) on the GPU into an f32 buffer
        (one submission), then attention over those rows (a second submission: the rows are
        far too large for the barrier-by-copy) — attend_flash where it plans the flash
        kernels (GPUs, or ``path`` "flash"; its default launch shape, untuned), else
        attend_direct."""
        lay = self.layout
        if self._recon is None:
            self._recon = self._new_buffer(2 * lay.n_kv_heads * lay.n_ctx * lay.head_dim, "storage",
                                           "reconstructed K/V")
        plan = self.passes.reconstruct_plan(layer, n_used, self._recon)
        plan.dispatch()
        ops = self.passes.rows_ops(self._recon, self.rows_plan(n_used), n_used, scale)
        self._upload_q(q, n_used)
        return self._eval(ops, f"attending over reconstructed layer {layer}")

    def rows_plan(self, n_used: int) -> P.Plan:
        """The plan of an attention over n_used reconstructed f32 rows (attend_reconstructed)."""
        locals_ = self.flash_locals_of("f32")
        if locals_ and self.path != "direct" and (self.local == GPU_LOCAL or self.path == "flash"):
            shape = T.Shape(locals_[0], self.flash_workgroups or T.workgroup_counts(self.compute_units, False)[0])
            return self.flash_shaped(n_used, shape)
        return P.Plan("direct", *P.split_count(n_used, self.preferred_splits, P.MIN_DIRECT_SPLIT_TOKENS,
                                               P.max_split_tokens("direct", 0, 0)))

    def free(self) -> None:
        if self.passes is not None:
            self.passes.free()
        self._free_flush()
        for b in self._buffers:
            b.destroy()
        self._buffers.clear()


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
