"""Decode attention over a KvArena's cache — the same call in both cache modes.

``KvArena.attend(layer, q, n_used, scale=None)`` (implemented here by :class:`Attention`)
attends one new query token per call: q (n_heads, head_dim) float32, grouped-query (query
head h reads KV head h // (n_heads / n_kv_heads)), causal over the first ``n_used`` cached
tokens, softmax(scale · q·k) with the maximum subtracted; returns (n_heads, head_dim)
float32. The NumPy twin is ``kvdict_vk.attention_ref.attend`` / ``attend_coded``.

Per layer, by how its streams are stored (shaders/attend_*.comp):

* both passthrough (the f32 cache, or a passthrough layer of a dict arena):
  attend_split_f32 → attend_combine → attend_reduce.
* at least one stream dict-coded: [attend_table if K is coded] → attend_split_coded →
  attend_combine → [attend_atoms if V is coded] → attend_reduce. K and V are never
  materialised: keys cost `sparsity` lookups in the q·atom table, values are gathered as
  atom weights and multiplied by the atoms once per query head (shaders/attend_split.comp
  says why).

Long contexts are split into chunks of tokens (flash-decoding): each (KV head, block of
query heads, split) is one invocation writing partial results — and, for a dict-coded V,
its atom weights; combine and reduce merge them. How many splits: a few per hardware
thread on CPU drivers, many on GPUs, at least what llvmpipe's loop limit requires
(loop_iterations). Kompute's Python API has no compute→compute barrier, so
between dependent dispatches of one submission we record an OpTensorSyncLocal of the
buffer just written: its shader-write→transfer barrier, chained with the transfer→shader
barrier Kompute records before every dispatch, orders the two dispatches and makes the
writes visible (the copy to the staging buffer itself is a by-product, small here).
"""
from __future__ import annotations

import math
import os

import numpy as np

from .. import errors as E
from .attend_specs import Sizes, n_blocks
from .device import kp
from .kernels import Buffer, Kernel

# Tokens per split, at least: a split's fixed costs (its records and, for a dict-coded V,
# zeroing its GROUP × n_atoms atom weights — each about what a token costs) must stay small
# next to its tokens.
MIN_SPLIT_TOKENS = 64
MIN_SPLIT_TOKENS_WEIGHTS = 256
MAX_SPLITS = 64  # per KV head
# llvmpipe silently ends an invocation's loops after 65535 iterations in total (all loops
# share one counter); a split's invocation stays well below (loop_iterations).
LOOP_BUDGET = 60000
CPU_SIMD_LANES = 8  # 32-bit lanes of llvmpipe's 256-bit vectors: the workgroup size on CPU drivers
SPLIT_LANES_PER_CPU = 8  # CPU drivers: splits (over all KV heads) per hardware thread
GPU_LOCAL = 64
HEAD_BLOCK_FLOATS = 192  # query (and accumulator) floats an invocation keeps for its block of heads
BINS_BUDGET_WORDS = 1 << 24  # the atom weights of all splits: at most 64 MiB


def loop_iterations(k_sparsity: int, v_sparsity: int) -> int:
    """Shader-loop iterations attend_split.comp spends per token, as llvmpipe counts them
    (measured: a loop of n iterations costs n + 1): 1 for f32 rows (one pass, rows loaded
    by unrolled code); dict-coded, 2 passes plus each coded stream's code-word loop (two
    code words per iteration)."""
    if not (k_sparsity or v_sparsity):
        return 1
    pairs = lambda s: (s + 1) // 2 + 1 if s else 0  # the code-word loops take two per iteration
    return 2 + pairs(k_sparsity) + pairs(v_sparsity)


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
        self.arena, self.device, self.layout = arena, arena.device, lay
        self.n_heads, self.group = n_heads, n_heads // lay.n_kv_heads
        self.hb = head_block(self.group, lay.head_dim)
        n_kv, hd, g = lay.n_kv_heads, lay.head_dim, self.group
        self.any_k_coded = any(ll.k.coded for ll in lay.layers)
        self.any_v_coded = any(ll.v.coded for ll in lay.layers)
        # The arena's shader mapping says which machine to plan for: "row" (CPU drivers:
        # a workgroup per SIMD row, a few splits per thread) or "chunk" (GPUs).
        cpu = arena.shader_mapping == "row"
        self.local = CPU_SIMD_LANES if cpu else GPU_LOCAL
        # Preferred splits per KV head: enough to give every hardware thread a full SIMD row
        # (CPU drivers) or to fill a GPU. Capacity: what the longest context needs under
        # the loop budget, at least the preferred count; the atom weights' memory caps it.
        want = SPLIT_LANES_PER_CPU * (os.cpu_count() or 2) if cpu else 1024
        self.preferred_splits = max(1, min(MAX_SPLITS, -(-want // (n_kv * (g // self.hb)))))
        needed = max(-(-lay.n_ctx // self._max_split_len(layer)) for layer in range(lay.n_layers))
        if needed > MAX_SPLITS:
            raise E.ArenaTooLargeError(f"attention over {lay.n_ctx} tokens needs {needed} splits per KV head "
                                       f"(at most {MAX_SPLITS}); use a shorter context or a lower sparsity")
        self.max_splits = max(needed, self.preferred_splits)
        if self.any_v_coded:
            per_split = n_kv * g * lay.n_atoms
            max_buf = self.device.limit("max_storage_buffer_range") // 4
            cap = min(BINS_BUDGET_WORDS, max_buf) // per_split
            if cap < needed:
                raise E.ArenaTooLargeError(f"{self.device.name}: the atom weights of {needed} splits "
                                           f"({needed * per_split} words) exceed the budget")
            self.max_splits = min(self.max_splits, cap)
            self.preferred_splits = min(self.preferred_splits, self.max_splits)
        self.sizes = sz = Sizes(n_kv, g, hd, max(lay.n_atoms, 1), lay.n_ctx, self.max_splits)
        self._kernels: dict = {}
        self._buffers: list[Buffer] = []
        self._recon = None
        try:
            new = self._new_buffer
            self.q = new(sz.out, "host", "attention query")
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
        except BaseException:
            self.free()
            raise

    def _clear_bins(self) -> None:
        """The split pass expects zero atom weights (attend_atoms.comp leaves them so after a
        completed attention): on creation, and after an attention that did not complete."""
        if self.bins is None or self._bins_clear:
            return
        self.bins.host_words()[:] = 0
        with self.device.guard("clearing the atom weights"):
            self.device.manager.sequence().eval(kp.OpTensorSyncDevice([self.bins.tensor]))
        self._bins_clear = True

    def _new_buffer(self, words: int, kind: str, name: str) -> Buffer:
        b = Buffer(self.device, words, kind, name)
        self._buffers.append(b)
        return b

    # --- planning ---------------------------------------------------------------------------------
    def _max_split_len(self, layer: int | None) -> int:
        """Tokens a split of this layer may hold under the loop budget (None: f32 rows)."""
        if layer is None:
            return LOOP_BUDGET // loop_iterations(0, 0)
        k, v = self.layout.layers[layer].streams
        return LOOP_BUDGET // loop_iterations(k.sparsity, v.sparsity)

    def splits(self, n_used: int, layer: int | None) -> tuple[int, int]:
        """(splits per KV head, tokens per split) for attending over n_used tokens of
        ``layer`` (None: f32 rows, e.g. reconstructed ones)."""
        v_coded = layer is not None and self.layout.layers[layer].v.coded
        min_tokens = MIN_SPLIT_TOKENS_WEIGHTS if v_coded else MIN_SPLIT_TOKENS
        n = max(1, min(self.preferred_splits, -(-n_used // min_tokens)), -(-n_used // self._max_split_len(layer)))
        split_len = -(-n_used // n)
        n = -(-n_used // split_len)
        if n > self.max_splits:
            raise E.ArenaError(f"attention over {n_used} tokens needs {n} splits, this engine holds {self.max_splits}")
        return n, split_len

    def _kernel(self, key, shader: str, buffers, items: int, **spec) -> Kernel:
        if key not in self._kernels:
            spec = {"HEAD_DIM": self.layout.head_dim, "GROUP": self.group, "LOCAL": self.local, "HB": self.hb,
                    **spec}
            self._kernels[key] = Kernel(self.device, shader, buffers, spec, max_items=items)
        return self._kernels[key]

    @staticmethod
    def _sync(*buffers):
        """The compute→compute barrier (module docstring): a sync of what was just written."""
        return kp.OpTensorSyncLocal([b.tensor for b in buffers])

    # --- the passes ---------------------------------------------------------------------------------
    def _ops(self, layer: int, n_used: int, scale: float, source=None) -> list:
        """The recorded operations of one attention over layer ``layer``. ``source``:
        (buffer, k_word, v_word, n_ctx) of f32 rows to attend over instead of the layer's
        own streams (reconstruct-then-attend)."""
        lay, sz, n_kv = self.layout, self.sizes, self.layout.n_kv_heads
        units = n_kv * (self.group // self.hb)
        k, v = lay.layers[layer].streams
        if source is None:
            buf, k_word, v_word, n_ctx = self.arena._layers[layer], k.region_word, v.region_word, lay.n_ctx
            tag, k_coded, v_coded = ("layer", layer), k.coded, v.coded
        else:
            buf, k_word, v_word, n_ctx = source
            tag, k_coded, v_coded = ("rows", id(buf)), False, False
        coded = k_coded or v_coded
        n_splits, split_len = self.splits(n_used, layer if source is None else None)
        split_push = dict(k_word=k_word, v_word=v_word, n_ctx=n_ctx, n_used=n_used, split_len=split_len,
                          n_splits=n_splits, n_kv=n_kv, n_atoms=max(lay.n_atoms, 1),
                          k_sparsity=k.sparsity if k_coded else 0, v_sparsity=v.sparsity if v_coded else 0,
                          k_scale_word=k.scale_word if k_coded and k.residual_bits else 0,
                          v_scale_word=v.scale_word if v_coded and v.residual_bits else 0,
                          head_vec=k.head_vec_stride, score_scale=scale)
        common = [buf, buf, self.q, self.accs, self.stats]
        ops = []
        if not coded:
            split = self._kernel(("split_f32",) + tag, "attend_split_f32", common, units * self.max_splits)
            ops += [split.op(**split_push), self._sync(self.stats, self.accs)]
        else:
            if k_coded:
                # a few contiguous runs of atoms per hardware thread (the query reload is the cost),
                # each within the loop budget
                runs = max(self.preferred_splits * units, -(-units * lay.n_atoms // (LOOP_BUDGET // 2)))
                table = self._kernel(("table", layer), "attend_table", [buf, self.q, self.table],
                                     min(units * lay.n_atoms, runs))
                ops += [table.op(atoms_word=k.atoms_word, head_atoms=k.head_atoms_stride, n_atoms=lay.n_atoms,
                                 n_kv=n_kv), self._sync(self.table)]
            spec = dict(K_CODED=int(k_coded), K_BITS=k.residual_bits, V_CODED=int(v_coded), V_BITS=v.residual_bits)
            # unused bindings: the query (read-only) for the table, a dummy for the weights
            split = self._kernel(("split_coded", layer), "attend_split_coded",
                                 common + [self.table if k_coded else self.q, self.bins if v_coded else self.dummy,
                                           self.scores], units * self.max_splits, **spec)
            ops += [split.op(**split_push), self._sync(self.stats, self.accs, *([self.bins] if v_coded else []))]
        combine = self._kernel(("combine",), "attend_combine", [self.stats], n_kv * self.group)
        ops += [combine.op(n_kv=n_kv, n_splits=n_splits, f_word=sz.f_word, inv_l_word=sz.inv_l_word),
                self._sync(self.stats)]
        if v_coded:  # the atom weights times the atoms (and the bins cleared for the next call)
            atoms = self._kernel(("atoms", layer), "attend_atoms", [buf, self.stats, self.bins, self.blocks],
                                 units * n_blocks(lay.n_atoms))
            ops += [atoms.op(atoms_word=v.atoms_word, head_atoms=v.head_atoms_stride, n_atoms=lay.n_atoms, n_kv=n_kv,
                             n_splits=n_splits, f_word=sz.f_word),
                    self._sync(self.blocks)]
        reduce = self._kernel(("reduce",) + tag, "attend_reduce",
                              [buf, self.stats, self.accs, self.blocks if v_coded else self.accs, self.out],
                              n_kv * self.group * lay.head_dim // 4)
        use_mean = v_coded and v.has_mean
        ops += [reduce.op(n_kv=n_kv, n_splits=n_splits, f_word=sz.f_word, inv_l_word=sz.inv_l_word,
                          n_blocks=n_blocks(lay.n_atoms) if v_coded else 0, use_mean=int(use_mean),
                          mean_word=v.mean_word if use_mean else 0, head_vec=v.head_vec_stride if use_mean else 0),
                self._sync(self.out)]
        return ops

    def _upload_q(self, q: np.ndarray) -> None:
        self.q.host_words()[:] = np.ascontiguousarray(q, np.float32).reshape(-1).view(np.uint32)

    def _eval(self, ops, what: str) -> None:
        self.arena._live()
        self._clear_bins()
        self._bins_clear = False
        with self.device.guard(what):
            seq = self.device.manager.sequence()
            for op in ops:
                seq.record(op)
            seq.eval()
        self._bins_clear = True

    def _result(self) -> np.ndarray:
        words = self.out.host_words()[:self.sizes.out]
        return words.view(np.float32).reshape(self.n_heads, self.layout.head_dim).copy()

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float) -> np.ndarray:
        ops = self._ops(layer, n_used, scale)
        self._upload_q(q)
        self._eval(ops, f"attending over layer {layer}")
        return self._result()

    def attend_reconstructed(self, layer: int, q: np.ndarray, n_used: int, scale: float) -> np.ndarray:
        """The reconstruct-then-attend baseline (benchmarks): reconstruct K and V of
        [0, n_used) on the GPU into an f32 buffer (one submission), then the f32 kernels
        over it (a second submission: the rows are far too large for the barrier-by-copy)."""
        lay = self.layout
        if self._recon is None:
            self._recon = self._new_buffer(2 * lay.n_kv_heads * lay.n_ctx * lay.head_dim, "storage",
                                           "reconstructed K/V")
        key = ("recon_plan", layer, n_used)
        if key not in self._kernels:
            from .reader import ReadPlan
            for old in [k for k in self._kernels if k[0] == "recon_plan"]:
                del self._kernels[old]  # its pipelines live in the arena's cache
            self._kernels[key] = ReadPlan(self.arena, layer, 0, n_used, out=self._recon)
        self._kernels[key].dispatch()
        source = (self._recon, 0, lay.n_kv_heads * n_used * lay.head_dim, n_used)
        ops = self._ops(layer, n_used, scale, source)
        self._upload_q(q)
        self._eval(ops, f"attending over reconstructed layer {layer}")
        return self._result()

    def free(self) -> None:
        for k in self._kernels.values():
            if isinstance(k, Kernel):
                k.destroy()
        self._kernels.clear()
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
    if scale is None:
        scale = 1.0 / math.sqrt(hd)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(scale)):
        raise E.ShapeError(f"attend: scale must be a finite number, got {scale!r}")
    return q, int(n_used), float(scale)
