"""The flash kernels' launch shapes (attend_flash over rows — f16, f32, q8_0, and its KIVI
builds over the KIVI cache's words —, attend_flash_coded over the codes):
which kernels fit a layer, their workgroup sizes, query heads per workgroup, split ends and
shared-memory buckets on this device, the candidates the tuner (kvdict_vk.vk.attend.tune)
times, and the flash plan of a launch shape.

FlashShapes takes what it needs explicitly — the device (its limits and subgroups), the
layout, the query heads per KV head and the engine's split capacity — and derives each fact
of a layer once (they are fixed for an engine's life). Its settings (coded_workgroups,
flash_workgroups, coded_heads, coded_kernel, flash_kernel, subgroups, exact, compute_units) are the
engine's: Attention forwards them, and tests and benchmarks fix them there.
"""
from __future__ import annotations

from ... import errors as E
from . import plan as P
from . import tune as T
from .specs import (FLASH_END_ELEMS, FLASH_FLOAT_END_ELEMS, FLASH_MAX_GROUP, MMA_HEAD_COLUMNS, MMA_KIVI_BITS,
                    MMA_LOCALS, MMA_MAX_HEAD_DIM, MMA_SUBGROUP, flash_coded_bucket, flash_round_tokens,
                    flash_shared_bytes, flash_units, mma_shared_bytes)
from ..abi import DECLARATIONS
from .tune import FLASH_CODED_LOCALS, FLASH_LOCALS  # the launch sizes live with the tuner

FLASH_MIN_SPLIT_TOKENS = 128  # attend_flash: a split's fixed costs (queries, record, merge) stay small
# attend_flash_coded: each workgroup loads its heads' q·atom table and multiplies its atom
# weights by every atom at the end (n_atoms × head_dim words from the L2): splits stay long
# (and few: attend_tune.workgroup_counts)
FLASH_CODED_MIN_SPLIT_TOKENS = 512
# The kernels over the codes, the untuned default first (the tuner times each): "float"
# (attend_flash_coded). Its fixed-point sibling lost everywhere once the float kernel's atom
# weights became owned (lab/NOTEBOOK.md) and went; a kernel over the codes for another device
# class would join here.
CODED_KERNELS = ("float",)
# attend_flash's builds, the untuned default first: "float" (attend_flash: the split's end 2
# elements of a unit a pass through shared memory, attend_specs.FLASH_FLOAT_END_ELEMS) and
# "wide_end" (attend_flash_wide: the end in a few barriers). The wide end is shorter, but its
# registers can halve the token loop's occupancy, slower at long contexts (lab/NOTEBOOK.md,
# "Registers"): the tuner times both. "int_dot" (attend_flash_dot: a q8_0 layer's keys dotted with
# an int8 query by integer dot products) runs over q8_0 rows where the device reports the feature
# (int_dot_fits), where the tuner times it beside the others (it is not exact: never with
# Attention.exact; timed against the float build in lab/NOTEBOOK.md, "Stop 69"). The KIVI builds
# (attend_flash_kivi) have the first only.
FLASH_KERNELS = ("float", "wide_end", "int_dot")
INT_DOT_KERNEL = "int_dot"
# attend_mma (shaders/attend_mma.comp): the same attention on cooperative matrices, over f16, q8_0
# and KIVI layers where the device has what it needs (mma_locals). It runs where asked for
# (Attention.flash_kernel = MMA_KERNEL); the tuner times it beside FLASH_KERNELS only with
# MMA_TUNED: on an H100 it was slower than attend_flash at every shape measured (lab/NOTEBOOK.md,
# "attend_mma"), so timing it would only lengthen every first call.
MMA_KERNEL = "mma"
MMA_TUNED = False


def max_local(device) -> int:
    """The largest one-dimensional workgroup ``device`` allows: the lesser of
    maxComputeWorkGroupInvocations and maxComputeWorkGroupSize[0] (every workgroup size
    chosen here and in attend_ops keeps within it)."""
    return min(device.limit("max_compute_work_group_invocations"), device.limit("max_compute_work_group_size")[0])


class FlashShapes:
    """The flash launch shapes of one engine: ``device``, ``layout``, ``group`` query heads per
    KV head and at most ``max_splits`` splits per KV head (the engine's records)."""

    def __init__(self, device, layout, group: int, max_splits: int):
        self.device, self.layout, self.group, self.max_splits = device, layout, group, max_splits
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
        # only the exact builds (float32 arithmetic, validated at NMSE ≤ 1e-9): no fast path such
        # as INT_DOT_KERNEL, which the tuner may pick otherwise (it meets issue 50's gate, 1e-5)
        self.exact: bool = False
        # the candidate workgroup counts (attend_tune.workgroup_counts: from the multiprocessors
        # the device reports); tests fix the count to plan as on another GPU
        self.compute_units = device.limit("compute_units") or 0
        # (what, layer) → a fact of the layer that planning reads on every step (the flash
        # kernels' workgroup sizes, whether one fits, the tuner's layer signature): they depend
        # on the layout, the group and the device's limits only, all fixed for the engine's
        # life, so they are derived once and never invalidated (_per_layer)
        self._layer_facts: dict[tuple, object] = {}

    def max_local(self) -> int:
        """The device's largest one-dimensional workgroup (max_local)."""
        return max_local(self.device)

    def _per_layer(self, what: str, layer: int, derive):
        """``derive()``, once per (what, layer) (see _layer_facts)."""
        key = (what, layer)
        if key not in self._layer_facts:
            self._layer_facts[key] = derive()
        return self._layer_facts[key]

    def flash_fits(self, layer: int) -> bool:
        """Whether a flash kernel can attend over ``layer``: attend_flash_coded (both streams
        dict-coded; keys coded before RoPE by its K_ROPE build, both streams' atoms then in one
        format; flash_coded_config) or attend_flash (both uncoded: flash_local)."""
        def derive() -> bool:
            k, v = self.layout.layers[layer].streams
            if k.key_rope is not None and not (v.coded and k.atoms_f16 == v.atoms_f16):
                return False
            if k.coded and v.coded:
                return self.flash_coded_heads(layer) > 0
            if k.coded or v.coded or k.rows != v.rows:
                return False
            return self.flash_local(layer) > 0
        return self._per_layer("flash_fits", layer, derive)

    def layer_signature(self, layer: int) -> tuple:
        """attend_tune's signature of ``layer`` (what its launch shape depends on besides the context)."""
        return self._per_layer("signature", layer,
                               lambda: T.layer_signature(self.device, self.layout, self.group, layer))

    def flash_locals(self, layer: int) -> list[int]:
        """attend_flash's workgroup sizes over an uncoded ``layer``, preferred first (empty: it
        cannot): at most FLASH_MAX_GROUP query heads per KV head, head_dim a multiple of 8
        (a unit of 8 elements per invocation) or 32 (q8_0 blocks); those of FLASH_LOCALS
        (attend_tune) the device allows that the row's units divide and where the untuned build,
        FLASH_KERNELS[0], fits (flash_end_elems: its split end's shared memory)."""
        k = self.layout.layers[layer].k
        return [] if k.coded else self.flash_locals_of(k.rows)

    def flash_locals_of(self, rows: str) -> list[int]:
        """attend_flash's workgroup sizes over ``rows`` ("f16", "f32", "q8_0", "kivi"), preferred
        first (flash_locals; the reconstruct-then-attend path asks for "f32")."""
        def derive() -> tuple[int, ...]:
            hd = self.layout.head_dim
            if self.group > FLASH_MAX_GROUP or hd % (32 if rows in ("q8_0", "kivi") else 8):
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

    def int_dot_fits(self, layer: int) -> bool:
        """Whether attend_flash_dot (build INT_DOT_KERNEL) can attend over ``layer``: q8_0 rows on
        a device with the variant's features (integer dot products)."""
        k = self.layout.layers[layer].k
        return (not k.kivi and k.rows == "q8_0"
                and set(DECLARATIONS["attend_flash_dot"].features) <= set(self.device.features()))

    def flash_kernel_fits(self, layer: int, kernel: str) -> bool:
        """Whether attend_flash's build ``kernel`` (FLASH_KERNELS) can attend over the uncoded
        ``layer``, asked for or tuned: the first everywhere, the others not over a KIVI layer,
        INT_DOT_KERNEL where int_dot_fits."""
        if kernel == INT_DOT_KERNEL:
            return self.int_dot_fits(layer)
        return kernel == FLASH_KERNELS[0] or (kernel in FLASH_KERNELS and not self.layout.layers[layer].k.kivi)

    def flash_kernels(self, layer: int) -> tuple[str, ...]:
        """The builds the tuner times over an uncoded ``layer``: those of FLASH_KERNELS that fit
        (flash_kernel_fits), and with MMA_TUNED
        MMA_KERNEL where it fits (mma_locals); with ``exact`` the exact builds only."""
        fast = not self.exact
        rows = tuple(n for n in FLASH_KERNELS
                     if self.flash_kernel_fits(layer, n) and (n != INT_DOT_KERNEL or fast))
        return rows + ((MMA_KERNEL,) if MMA_TUNED and fast and self.mma_locals(layer) else ())

    def flash_kernel_locals(self, layer: int, kernel: str) -> list[int]:
        """The workgroup sizes over an uncoded ``layer`` for build ``kernel`` (FLASH_KERNELS:
        where it fits, flash_kernel_fits, those of flash_locals whose split end fits,
        flash_end_elems; MMA_KERNEL: mma_locals)."""
        if kernel == MMA_KERNEL:
            return self.mma_locals(layer)
        if kernel in FLASH_KERNELS and not self.flash_kernel_fits(layer, kernel):
            return []  # (an unknown one: flash_end_elems says so)
        return [n for n in self.flash_locals(layer) if self.flash_end_elems(n, kernel)]

    def mma_locals(self, layer: int) -> list[int]:
        """attend_mma's workgroup sizes over ``layer`` (MMA_LOCALS that fit; empty: it cannot):
        f16, q8_0 or KIVI rows (KIVI levels of MMA_KIVI_BITS, an arena of one sequence),
        head_dim a multiple of 32 up to MMA_MAX_HEAD_DIM, at most MMA_HEAD_COLUMNS query heads
        per KV head, a device with its features (abi.MMA_FEATURES), subgroups of MMA_SUBGROUP
        with its operations, and ``subgroups`` not False."""
        def derive() -> tuple[int, ...]:
            k, v = self.layout.layers[layer].streams
            rows = "kivi" if k.kivi else k.rows
            decl = DECLARATIONS["attend_mma_kivi" if k.kivi else "attend_mma"]
            dev, hd = self.device, self.layout.head_dim
            fits = (rows in ("f16", "q8_0", "kivi") and k.rows == v.rows and not (k.coded or v.coded)
                    and hd % 32 == 0 and hd <= MMA_MAX_HEAD_DIM and self.group <= MMA_HEAD_COLUMNS
                    and (not k.kivi or ({k.kivi_bits, v.kivi_bits} <= set(MMA_KIVI_BITS) and k.kivi_seqs == 1))
                    and set(decl.features) <= set(dev.features()) and dev.limit("subgroup_size") == MMA_SUBGROUP
                    and set(decl.subgroup_ops) <= set(dev.subgroup_operations()))
            limit = dev.limit("max_compute_shared_memory_size")
            return tuple(n for n in MMA_LOCALS if fits and n <= self.max_local()
                         and mma_shared_bytes(hd, n, rows) <= limit)
        if self.subgroups is False:
            return []
        return list(self._per_layer("mma_locals", layer, derive))

    def flash_variant(self, local: int, shader: str = "attend_flash") -> str:
        """The SPIR-V of ``shader`` — attend_flash, its wide end or its KIVI build, spreading a token over
        flash_units(head_dim) invocations — at ``local`` invocations: its _sg
        build where the device's subgroups can sum a token's partial scores
        (Device.shuffles_fit: a token's units) and ``subgroups`` allows, else the plain one
        (shared memory, no optional feature). Derived once per (shader, size, setting):
        planning asks on every step."""
        if shader.startswith("attend_mma"):
            return shader  # subgroups always (mma_locals)

        def derive() -> str:
            fits = self.device.shuffles_fit(flash_units(self.layout.head_dim), local)
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
            k, v = self.layout.layers[layer].streams
            return flash_coded_bucket(self.layout.head_dim, hb, local, self.layout.n_atoms, v.sparsity,
                                      v.residual_bits, self.device.limit("max_compute_shared_memory_size"),
                                      k.key_rope is not None)
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

    def flash_candidates(self, layer: int, seqs: int = 1) -> list[T.Shape]:
        """The launch shapes of ``layer``'s flash kernel the tuner times, the untuned one first:
        every kernel build, query heads per workgroup (over the codes) and workgroup size the
        layer and device allow (or the settings force), at every workgroup count of
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
                for kernel in self.flash_kernels(layer) if self.flash_kernel is None else (self.flash_kernel,):
                    shapes += T.candidates([(0, self.flash_kernel_locals(layer, kernel))],
                                           T.workgroup_counts(self.compute_units, False), kernel)
                if not shapes:
                    raise E.ArenaError(f"layer {layer}: attend_flash ({self.flash_kernel}) has no workgroup size here")
            distinct = {}
            for sh in shapes:
                distinct.setdefault((sh.local, sh.heads, sh.kernel, self.splits_wanted(sh, seqs)), sh)
            return tuple(distinct.values())
        setting = (seqs, self.coded_kernel, self.coded_heads, self.flash_kernel, self.compute_units, self.exact)
        return list(self._per_layer(("flash_candidates",) + setting, layer, derive))

    def plan(self, layer: int, n_used: int, seqs: int = 1, time_plan=None) -> P.Plan:
        """The flash kernel's plan: a launch shape (workgroup size, workgroups) measured on
        the device (attend_tune) by ``time_plan(layer, n_used, plan) -> seconds | None`` unless
        fixed by ``flash_workgroups`` / ``coded_workgroups`` or not given (the engine gives none
        on a CPU driver, untuned, or without timestamps), and the splits that make that many
        workgroups."""
        coded = self.layout.layers[layer].k.coded
        shapes = self.flash_candidates(layer, seqs)
        fixed = self.coded_workgroups if coded else self.flash_workgroups

        kivi = self.layout.layers[layer].k.kivi

        def shaped(shape: T.Shape) -> P.Plan:
            return self.flash_shaped(n_used, shape, seqs, kivi)
        if fixed is None and time_plan is not None:
            forced = tuple(x for x in (self.coded_heads, self.coded_kernel) if x is not None) if coded else \
                ((self.flash_kernel,) if self.flash_kernel is not None else ())
            forced += (("seqs", seqs),) if seqs > 1 else ()
            forced += ("exact",) if self.exact else ()
            shape = T.choose(self.layer_signature(layer) + forced, n_used, shapes,
                             lambda sh: time_plan(layer, n_used, shaped(sh)))
        else:
            first = shapes[0]
            shape = T.Shape(first.local, fixed or first.workgroups, first.heads, first.kernel)
        return shaped(shape)

    def flash_shaped(self, n_used: int, shape: T.Shape, seqs: int = 1, kivi: bool = False) -> P.Plan:
        """The flash plan of a launch shape (over the codes where ``shape.heads`` is set, over a
        KIVI layer's words where ``kivi``): the splits that make ``shape.workgroups`` workgroups
        over the KV heads (and head blocks) of ``seqs`` sequences, each at least
        FLASH_(CODED_)MIN_SPLIT_TOKENS long and a whole number of the kernel's rounds
        (attend_specs.flash_round_tokens)."""
        coded = shape.heads > 0
        rounds = flash_round_tokens(self.layout.head_dim, shape.local, coded, kivi, shape.kernel == MMA_KERNEL)
        min_tokens = FLASH_CODED_MIN_SPLIT_TOKENS if coded else FLASH_MIN_SPLIT_TOKENS
        # a KIVI split starts on a key group: a whole number of rounds always, or the only split
        most = n_used + rounds if kivi else n_used
        n, split_len = P.split_count(n_used, self.splits_wanted(shape, seqs), min_tokens, most, rounds)
        return P.Plan("flash", n, split_len, local=shape.local, heads=shape.heads, kernel=shape.kernel, seqs=seqs,
                      split_round=rounds)

    def splits_wanted(self, shape: T.Shape, seqs: int = 1) -> int:
        """Splits per virtual head (sequence × KV head) that make at most ``shape.workgroups``
        workgroups over the virtual heads and head blocks — rounded down, so a count of whole
        waves stays whole (rounded up, a count can become a wave and a fraction, which measured
        slower: lab/NOTEBOOK.md, "Batched decode") — within the capacity."""
        blocks = seqs * self.layout.n_kv_heads * (self.group // shape.heads if shape.heads else 1)
        return min(self.max_splits, max(1, shape.workgroups // blocks))
