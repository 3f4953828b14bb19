"""Buffers and checked dispatches: every shader's contract, enforced in Python first.

A :class:`ShaderSpec` says what a shader variant binds (and with which element width),
which push-constant block (from :mod:`kvdict_vk.layout`) and which specialization
constants it takes, and which words of each binding a dispatch touches for given push
constants. A :class:`Kernel` is one variant bound to concrete buffers (a Kompute
Algorithm). Before anything reaches the driver we check the binding count against the
SPIR-V itself, the push-constant size, the specialization IDs, buffer sizes, alignment,
and that no dispatch reads or writes outside its buffers: a mismatch is a
:class:`~kvdict_vk.errors.DispatchError`, never a crash.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import errors as E
from .. import kivi as K
from .. import layout as L
from ..residual import slot_words
from . import spirv
from .device import Device, kp

WG_SIZE = 64  # the shaders' local_size_x (common.glsl)
MAX_WORKGROUPS = 4096  # soft cap; grid-stride loops cover any excess work


class Buffer:
    """One Vulkan storage buffer of 32-bit words (a Kompute tensor).

    kind "storage": device-local, shader-only (layer buffers); "host": host-visible and
    coherent, written by the host and read by shaders (uploads: host writes are visible to
    a later submission without any copy); "device": device-local with a staging copy,
    read back with OpTensorSyncLocal, whose barriers make shader writes visible to the host.
    """
    _KINDS = {"storage": kp.TensorTypes.storage, "host": kp.TensorTypes.host,
              "device": kp.TensorTypes.device}

    def __init__(self, device: Device, words: int, kind: str, name: str, init: np.ndarray | None = None):
        if kind not in self._KINDS:
            raise E.ArenaError(f"unknown buffer kind {kind!r}")
        if words < 1:
            raise E.ArenaError(f"{name}: a buffer needs at least one word")
        data = np.zeros(words, np.uint32) if init is None else np.ascontiguousarray(init).view(np.uint32)
        if data.size != words:
            raise E.ArenaError(f"{name}: initial data has {data.size} words, expected {words}")
        self.device, self.words, self.kind, self.name = device, int(words), kind, name
        with device.guard(f"allocating {name} ({4 * words} bytes, {kind})"):
            self.tensor = device.manager.tensor_t(data, self._KINDS[kind])
        self.alive = True

    def host_words(self) -> np.ndarray:
        """A uint32 view of the host-visible memory (host buffers, or the staging copy of
        device buffers after OpTensorSyncLocal). Valid until the buffer is destroyed."""
        if not self.alive or self.kind == "storage":
            raise E.ArenaError(f"{self.name}: no host-visible memory ({self.kind}, alive={self.alive})")
        return self.tensor.data()

    def destroy(self) -> None:
        if self.alive:
            self.alive = False
            with self.device.guard(f"freeing {self.name}"):
                self.tensor.destroy()


Span = tuple  # (first word, one past the last word) touched in one binding; each binding
# gets a list of spans (empty: untouched)


@dataclass(frozen=True)
class ShaderSpec:
    variant: str  # SPIR-V name (shader_build.VARIANTS)
    push: L.PushBlock
    lanes: tuple  # per binding: words per element (4 for vec4/uvec4 views)
    writes: tuple  # per binding: whether the shader writes it
    spec_names: tuple  # specialization constants by constant_id
    extents: Callable  # (push dict, spec dict) -> per binding, a list of Spans
    groups: Callable = lambda spec: 1  # invocations that share one row (grid stride % groups == 0)
    optional_spec: tuple = ()  # ((name, default), …): may be omitted, and may be 0
    subgroup_ops: tuple = ()  # subgroup operation classes it uses (the device must report them)


def _rows_extents(p, row_words: int) -> Span:
    """Words of a region read for rows (h, t0 .. t0+n_tok) of every head."""
    n_kv = p["n_rows"] // p["n_tok"]
    lo = p["src_word"] + p["t0"] * row_words
    hi = p["src_word"] + ((n_kv - 1) * p["n_ctx"] + p["t0"] + p["n_tok"]) * row_words
    return lo, hi


def _check_rows(p) -> None:
    if p["n_rows"] and (p["n_tok"] < 1 or p["n_rows"] % p["n_tok"] or p["t0"] + p["n_tok"] > p["n_ctx"]):
        raise E.DispatchError(f"row range n_rows={p['n_rows']} n_tok={p['n_tok']} t0={p['t0']} "
                              f"n_ctx={p['n_ctx']} is inconsistent")


def _reconstruct_extents(p, s, lanes: int):
    _check_rows(p)
    hd, bits = s["HEAD_DIM"], s["RES_BITS"]
    if p["n_atoms"] < 1:
        raise E.DispatchError("n_atoms must be ≥ 1 (out-of-range codes read atom 0)")
    if not p["n_rows"]:
        return [], [], [], []
    last = p["n_rows"] // p["n_tok"] - 1  # the last KV head read: strides × last
    atoms = (p["atoms_word"], p["atoms_word"] + last * p["head_atoms"] + p["n_atoms"] * hd)
    elems = [] if s["ATOMS_F16"] else [atoms]
    elems.append((p["mean_word"], p["mean_word"] + last * p["head_vec"] + hd))
    if bits:
        elems.append((p["scale_word"], p["scale_word"] + last * p["head_vec"] + hd))
    halves = []
    if s["ATOMS_F16"]:
        if lanes != 4 or hd % L.ATOMS_F16_ELEMS:
            raise E.DispatchError(f"binary16 atoms are gathered a quad (8 halves) at a time: the vec4 variant "
                                  f"with head_dim % {L.ATOMS_F16_ELEMS} == 0 (head_dim {hd}, "
                                  f"{'vec4' if lanes == 4 else 'scalar'} variant)")
        halves.append((p["atoms16_word"], p["atoms16_word"] + (last * p["head_atoms"] + p["n_atoms"] * hd) // 2))
    return ([_rows_extents(p, slot_words(hd, s["SPARSITY"], bits))], elems,
            [(p["out_word"], p["out_word"] + p["n_rows"] * hd)], halves)


def _copy_rows_extents(p, s):
    _check_rows(p)
    if not p["n_rows"]:
        return [], []
    hd = s["HEAD_DIM"]
    return [_rows_extents(p, hd)], [(p["out_word"], p["out_word"] + p["n_rows"] * hd)]


@dataclass(frozen=True)
class Write:
    """Words (heads, rows, row_words) for a buffer, in the scatter shader's shape: head h's
    rows at dst_word + h · group_stride, its rows contiguous."""
    dst_word: int
    words: np.ndarray
    group_stride: int


def _scatter_extents(p, s):
    n, rw, gr = p["n_words"], p["row_words"], p["group_rows"]
    if not n:
        return [], []
    if rw < 1 or gr < 1 or n % rw:
        raise E.DispatchError(f"scatter: n_words {n} is not whole rows of {rw} words (group_rows {gr})")
    rows = n // rw
    if rows > gr and p["group_stride"] < gr * rw:
        raise E.DispatchError(f"scatter: group_stride {p['group_stride']} < {gr}×{rw}: groups overlap")
    last = rows - 1
    g, i = divmod(last, gr)
    return [(p["src_word"], p["src_word"] + n)], [(p["dst_word"], p["dst_word"] + g * p["group_stride"] + (i + 1) * rw)]


def _read_f16_extents(p, s):
    _check_rows(p)
    if not p["n_rows"]:
        return [], []
    hd = s["HEAD_DIM"]
    if hd % 2:
        raise E.DispatchError(f"read_rows_f16: HEAD_DIM {hd} is odd")
    return [_rows_extents(p, hd // 2)], [(p["out_word"], p["out_word"] + p["n_rows"] * hd)]


def _read_q8_extents(p, s):
    _check_rows(p)
    if not p["n_rows"]:
        return [], []
    hd = s["HEAD_DIM"]
    if hd % L.Q8_BLOCK:
        raise E.DispatchError(f"read_rows_q8: HEAD_DIM {hd} is not whole q8_0 blocks")
    return [_rows_extents(p, L.row_words(hd, 0, 0, "q8_0"))], [(p["out_word"], p["out_word"] + p["n_rows"] * hd)]


def _read_kivi_extents(p, s):
    _check_rows(p)
    hd, bits, keys = s["HEAD_DIM"], s["BITS"], s["KEYS"]
    if s["GROUP"] != K.GROUP or hd % K.GROUP or not K.MIN_BITS <= bits <= K.MAX_BITS or keys not in (0, 1) \
            or p["window"] < 1:
        raise E.DispatchError(f"read_rows_kivi: HEAD_DIM {hd}, BITS {bits}, KEYS {keys}, GROUP {s['GROUP']}, "
                              f"window {p['window']}")
    reads = [(p["state_word"], p["state_word"] + 1)]
    if p["n_rows"]:
        n_kv = p["n_rows"] // p["n_tok"]
        row = K.key_row_words(hd, bits) if keys else K.value_row_words(hd, bits)
        reads += [_rows_extents(p, row),
                  (p["window_word"], p["window_word"] + n_kv * K.window_words_per_head(p["window"], hd))]
        if keys:
            reads.append((p["stats_word"], p["stats_word"] + n_kv * K.stats_words_per_head(p["n_ctx"], hd)))
    return reads, [(p["out_word"], p["out_word"] + p["n_rows"] * hd)] if p["n_rows"] else []


def _copy_extents(p, s):
    n = p["n_words"]
    return ([(p["src_word"], p["src_word"] + n)], [(p["dst_word"], p["dst_word"] + n)]) if n else ([], [])


def _flush_extents(p, s):
    n = p["n_words"]
    if n % 4:
        raise E.DispatchError(f"l2_flush reads whole vec4s: n_words {n} is not a multiple of 4")
    return ([(0, n)] if n else []), [(0, 1)]


def _row_groups(s, lanes):
    return s["HEAD_DIM"] // lanes // s["CHUNKS"]


SHADERS = {
    **{f"reconstruct_{v}": ShaderSpec(f"reconstruct_{v}", L.RECONSTRUCT_PUSH, (1, n, n, 4),
                                      (False, False, True, False),
                                      ("HEAD_DIM", "SPARSITY", "CHUNKS", "RES_BITS", "PIPELINED", "ATOMS_F16"),
                                      lambda p, s, n=n: _reconstruct_extents(p, s, n),
                                      lambda s, n=n: _row_groups(s, n),
                                      (("RES_BITS", 0), ("PIPELINED", 0), ("ATOMS_F16", 0)))
       for v, n in (("vec4", 4), ("scalar", 1))},
    **{f"copy_rows_{v}": ShaderSpec(f"copy_rows_{v}", L.COPY_ROWS_PUSH, (n, n), (False, True),
                                    ("HEAD_DIM", "CHUNKS"), _copy_rows_extents, lambda s, n=n: _row_groups(s, n))
       for v, n in (("vec4", 4), ("scalar", 1))},
    **{f"copy_{v}": ShaderSpec(f"copy_{v}", L.COPY_PUSH, (n, n), (False, True), (), _copy_extents)
       for v, n in (("vec4", 4), ("scalar", 1))},
    "scatter": ShaderSpec("scatter", L.SCATTER_PUSH, (1, 1), (False, True), (), _scatter_extents),
    "l2_flush": ShaderSpec("l2_flush", L.FLUSH_PUSH, (4, 1), (False, True), (), _flush_extents),
    "read_rows_f16": ShaderSpec("read_rows_f16", L.COPY_ROWS_PUSH, (1, 2), (False, True), ("HEAD_DIM",),
                                _read_f16_extents),
    "read_rows_q8": ShaderSpec("read_rows_q8", L.COPY_ROWS_PUSH, (1, 4), (False, True), ("HEAD_DIM",),
                               _read_q8_extents),
    "read_rows_kivi": ShaderSpec("read_rows_kivi", L.READ_KIVI_PUSH, (1, 4), (False, True),
                                 ("HEAD_DIM", "BITS", "KEYS", "GROUP"), _read_kivi_extents,
                                 optional_spec=(("KEYS", 1),)),
}


def workgroups_for(device: Device, items: int, groups: int = 1, local: int = WG_SIZE) -> int:
    """Workgroup count for ``items`` work items (``local`` invocations per workgroup): ≤ the
    device limit and MAX_WORKGROUPS, and a multiple of groups/gcd(groups, local) so the
    grid stride is a multiple of ``groups`` (the shaders rely on that)."""
    step = groups // math.gcd(groups, local)
    limit = min(device.limit("max_compute_work_group_count")[0], MAX_WORKGROUPS)
    limit -= limit % step
    if limit < step:
        raise E.DispatchError(f"{device.name}: cannot dispatch a multiple of {step} workgroups")
    wanted = max(1, -(-items // local))
    return min(limit, -(-wanted // step) * step)


class Kernel:
    """One shader variant bound to buffers, with its specialization constants."""

    def __init__(self, device: Device, shader: str, buffers: list[Buffer], spec: dict | None = None,
                 max_items: int = 1):
        self.device, self.shader = device, SHADERS[shader]
        self.buffers, self.spec = list(buffers), {**dict(SHADERS[shader].optional_spec), **(spec or {})}
        sh = self.shader
        code = spirv.load(sh.variant)
        r = spirv.reflect(code)
        spirv.check_portable(sh.variant, r, min(128, device.limit("max_compute_work_group_invocations")),
                             sh.subgroup_ops)
        missing = set(sh.subgroup_ops) - set(device.subgroup_operations())
        if missing:
            raise E.DispatchError(f"{sh.variant}: uses subgroup operations {sorted(missing)} that "
                                  f"{device.name} does not report for compute shaders")
        if len(r.bindings) > device.limit("max_per_stage_storage_buffers"):
            raise E.DispatchError(f"{sh.variant}: binds {len(r.bindings)} storage buffers, the device "
                                  f"allows {device.limit('max_per_stage_storage_buffers')} per stage")
        if len(r.bindings) != len(sh.lanes) or len(self.buffers) != len(sh.lanes):
            raise E.DispatchError(f"{sh.variant}: the SPIR-V binds {len(r.bindings)} buffers, the spec "
                                  f"{len(sh.lanes)}, given {len(self.buffers)}")
        if r.push_constant_bytes != sh.push.size_bytes:
            raise E.DispatchError(f"{sh.variant}: push block is {r.push_constant_bytes} bytes in SPIR-V, "
                                  f"{sh.push.size_bytes} in layout.{sh.push.name}")
        if sh.push.size_bytes > device.limit("max_push_constants_size"):
            raise E.DispatchError(f"{sh.variant}: push block exceeds maxPushConstantsSize")
        if r.spec_ids != tuple(range(len(sh.spec_names))) or set(self.spec) != set(sh.spec_names):
            raise E.DispatchError(f"{sh.variant}: specialization {sorted(self.spec)} vs SPIR-V ids {r.spec_ids} "
                                  f"({sh.spec_names})")
        for i, b in enumerate(self.buffers):
            if not b.alive:
                raise E.DispatchError(f"{sh.variant}: buffer {b.name} was freed")
            if sh.writes[i] and sum(x is b for x in self.buffers) > 1:
                raise E.DispatchError(f"{sh.variant}: {b.name} is written through binding {i} and also bound elsewhere")
        self._check_spec()
        # Shaders with a specialized workgroup size (local_size_x_id) name it LOCAL.
        self.local = self.spec.get("LOCAL", WG_SIZE)
        if not 1 <= self.local <= min(device.limit("max_compute_work_group_invocations"),
                                      device.limit("max_compute_work_group_size")[0]):
            raise E.DispatchError(f"{sh.variant}: workgroup size {self.local} exceeds the device's limits")
        self.groups = sh.groups(self.spec) if sh.spec_names else 1
        self.workgroups = workgroups_for(device, max_items * self.groups, self.groups, self.local)
        spec_arr = np.array([self.spec[n] for n in sh.spec_names], np.uint32)
        # Kompute takes the push-constant dtype from spec_consts: both uint32 (DESIGN.md).
        with device.guard(f"creating pipeline {sh.variant}"):
            self.algorithm = device.manager.algorithm(
                [b.tensor for b in self.buffers], code, [self.workgroups, 1, 1], spec_arr,
                np.zeros(len(sh.push.fields), np.uint32))

    def _check_spec(self) -> None:
        # chunks are of the output's elements (the written binding's view)
        s, lanes = self.spec, max(n for n, w in zip(self.shader.lanes, self.shader.writes) if w)
        may_be_zero = {n for n, _ in self.shader.optional_spec}
        if any(not isinstance(v, (int, np.integer)) or not (0 if n in may_be_zero else 1) <= v < 1 << 32
               for n, v in s.items()):
            raise E.DispatchError(f"{self.shader.variant}: specialization {s} must be positive uint32s")
        if "CHUNKS" in s and (s["HEAD_DIM"] % lanes or (s["HEAD_DIM"] // lanes) % s["CHUNKS"]):
            raise E.DispatchError(f"{self.shader.variant}: HEAD_DIM {s['HEAD_DIM']} is not {s['CHUNKS']} "
                                  f"chunks of {lanes}-word elements")

    def op(self, **push) -> "kp.OpAlgoDispatch":
        """A checked dispatch op for these push constants (record it in a Sequence)."""
        sh = self.shader
        words = sh.push.pack(**push)
        push = {**dict(sh.push.defaults), **push}
        for b in self.buffers:
            if not b.alive:
                raise E.DispatchError(f"{sh.variant}: buffer {b.name} was freed")
        spans = sh.extents(push, self.spec)
        for i, (binding_spans, b, lanes) in enumerate(zip(spans, self.buffers, sh.lanes)):
            for lo, hi in binding_spans:
                if lo < 0 or hi > b.words or lo > hi:
                    raise E.DispatchError(f"{sh.variant}: binding {i} ({b.name}, {b.words} words) would "
                                          f"be accessed at words [{lo}, {hi})")
                if lanes > 1 and (lo % lanes or (hi - lo) % lanes):
                    raise E.DispatchError(f"{sh.variant}: binding {i} span [{lo}, {hi}) is not vec4-aligned")
        return kp.OpAlgoDispatch(self.algorithm, words)

    def destroy(self) -> None:
        if self.algorithm is not None:
            with self.device.guard(f"destroying pipeline {self.shader.variant}"):
                self.algorithm.destroy()
            self.algorithm = None


HAS_COMPUTE_BARRIER = hasattr(kp, "OpComputeBarrier")


def barrier(*buffers: "Buffer"):
    """The compute→compute barrier between a dispatch that writes ``buffers`` and a later
    one in the same submission that reads or writes them: kp.OpComputeBarrier, which
    scripts/setup.sh binds from Kompute's C++ OpMemoryBarrier (kp 0.9.0 does not expose
    it; scripts/kp_patch.py). With a stock kp, the fallback is a sync of each "device"
    buffer to its staging copy, whose compute→transfer barrier chains with the
    transfer→compute barrier Kompute records before every dispatch — it orders
    dispatches, but does nothing for "storage" buffers and is a best effort the
    synchronization validation layer rejects."""
    if HAS_COMPUTE_BARRIER:
        return kp.OpComputeBarrier([b.tensor for b in buffers])
    return kp.OpTensorSyncLocal([b.tensor for b in buffers if b.kind == "device"] or [buffers[0].tensor])


def run(device: Device, *ops, what: str = "dispatch") -> None:
    """Record ``ops`` on the device's reused sequence, submit, wait (Device.submit)."""
    device.submit(*ops, what=what)


# Decode attention (kvdict_vk/vk/attend.py): its contracts live in attend_specs
from .attend import specs as _attend_specs  # noqa: E402 (needs ShaderSpec, defined above)

SHADERS.update(_attend_specs.shader_specs(ShaderSpec))

# GPU OMP encoder (kvdict_vk/vk/encoder.py): its contracts live in encode_specs
from .encode import specs as _encode_specs  # noqa: E402 (needs ShaderSpec, defined above)

SHADERS.update(_encode_specs.shader_specs(ShaderSpec, L.ENCODE_PUSH, WG_SIZE))
