"""Buffers and checked dispatches: every shader's contract, enforced in Python first.

A :class:`~kvdict_vk.vk.shaders.ShaderSpec` (``SHADERS``) is a variant's declaration —
what it binds and with which element width, its push-constant block, its specialization
constants, the device features it needs (:mod:`kvdict_vk.vk.abi`) — with the words of each
binding a dispatch touches for given push constants. A :class:`Kernel` is one variant bound
to concrete buffers (a Kompute Algorithm). Before anything reaches the driver we check the
binding count against the SPIR-V itself, the push-constant size, the specialization IDs,
the device features, buffer sizes, alignment, and that no dispatch reads or writes outside
its buffers: a mismatch is a :class:`~kvdict_vk.errors.DispatchError`, never a crash.
"""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import numpy as np

from .. import errors as E
from . import abi, spirv
from .device import Device, kp
from . import shaders
from .shaders import SHADERS  # noqa: F401 (every registered variant: tests, tools)

WG_SIZE = abi.WG_SIZE  # the shaders' local_size_x (common.glsl), unless specialized (abi.Variant.local)
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
        self.uid = next(_BUFFER_IDS)
        self.pipeline_keys: set = set()  # the device's cached pipelines that bind this buffer

    def host_words(self) -> np.ndarray:
        """A uint32 view of the host-visible memory (host buffers, or the staging copy of
        device buffers after OpTensorSyncLocal). Valid until the buffer is destroyed."""
        if not self.alive or self.kind == "storage":
            raise E.ArenaError(f"{self.name}: no host-visible memory ({self.kind}, alive={self.alive})")
        return self.tensor.data()

    def destroy(self) -> None:
        """Free the buffer, and first every cached pipeline of the device that binds it."""
        if self.alive:
            self.alive = False
            with self.device.guard(f"freeing {self.name}"):
                pipelines = _PIPELINES.get(self.device, {})
                for key in self.pipeline_keys:
                    kernel = pipelines.pop(key, None)
                    if kernel is not None:
                        kernel.destroy()
                self.pipeline_keys.clear()
                self.tensor.destroy()


_BUFFER_IDS = itertools.count()
# Each device's pipelines (pipeline()): key -> Kernel. Kompute binds buffers when it makes a
# pipeline, so a pipeline lives as long as the first of its buffers (Buffer.destroy).
_PIPELINES: "weakref.WeakKeyDictionary[Device, dict]" = weakref.WeakKeyDictionary()


def pipeline(device: Device, shader: str, buffers: list, spec: dict | None = None, max_items: int = 1,
             rows: int = 1) -> "Kernel":
    """The device's pipeline for this variant, specialization, buffers and size: made on
    first use and shared by every owner that asks for the same one afterwards (the arena's
    writes and reads, the attention passes, the encoder), freed with its buffers. Owners
    keep no pipelines of their own and never destroy one. ``rows``: workgroups along y (a
    device forward's sequences: the shader strides over its rows by gl_NumWorkGroups.y)."""
    key = (shader, tuple(sorted((spec or {}).items())), tuple(b.uid for b in buffers), int(max_items), int(rows))
    with device.guard(f"looking up pipeline {shader}"):
        pipelines = _PIPELINES.setdefault(device, {})
        made = pipelines.get(key)
        if made is None:
            made = Kernel(device, shader, buffers, spec, max_items, rows)
            made.cache_key = key
            pipelines[key] = made
            for b in buffers:
                b.pipeline_keys.add(key)
        return made


def release(made: "Kernel") -> None:
    """Drop one pipeline from its device's cache and destroy it now, for an owner that bounds
    how many of its pipelines live at once (the encoder's, one per destination buffer)."""
    device = made.device
    with device.guard(f"releasing pipeline {made.shader.variant}"):
        key = made.cache_key
        if key is not None and _PIPELINES.get(device, {}).get(key) is made:
            del _PIPELINES[device][key]
            for b in made.buffers:
                b.pipeline_keys.discard(key)
        made.destroy()


def pipeline_count(device: Device) -> int:
    """How many pipelines the device's cache holds (a steady decode adds none)."""
    return len(_PIPELINES.get(device, {}))


@dataclass(frozen=True)
class Write:
    """Words (heads, rows, row_words) for a buffer, in the scatter shader's shape: head h's
    rows at dst_word + h · group_stride, its rows contiguous."""
    dst_word: int
    words: np.ndarray
    group_stride: int


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

    cache_key = None  # its key in the device's pipeline cache (pipeline()), None outside it

    def __init__(self, device: Device, shader: str, buffers: list[Buffer], spec: dict | None = None,
                 max_items: int = 1, rows: int = 1):
        self.device, self.shader = device, shaders.spec(shader)
        self.buffers, self.spec = list(buffers), {**dict(self.shader.optional_spec), **(spec or {})}
        sh = self.shader
        code = spirv.load(sh.variant)
        r = spirv.reflect(code)
        spirv.check_portable(sh.variant, r, min(128, device.limit("max_compute_work_group_invocations")),
                             sh.subgroup_ops, sh.features)
        missing = set(sh.subgroup_ops) - set(device.subgroup_operations())
        if missing:
            raise E.DispatchError(f"{sh.variant}: uses subgroup operations {sorted(missing)} that "
                                  f"{device.name} does not report for compute shaders")
        lacking = [f for f in sh.features if f not in device.features()]
        if lacking:
            raise E.DispatchError(f"{sh.variant}: needs device features {lacking} that {device.name} does not "
                                  f"report or this backend does not enable (Device.features)")
        if len(r.bindings) > device.limit("max_per_stage_storage_buffers"):
            raise E.DispatchError(f"{sh.variant}: binds {len(r.bindings)} storage buffers, the device "
                                  f"allows {device.limit('max_per_stage_storage_buffers')} per stage")
        if len(r.bindings) != len(sh.lanes) or len(self.buffers) != len(sh.lanes):
            raise E.DispatchError(f"{sh.variant}: the SPIR-V binds {len(r.bindings)} buffers, the spec "
                                  f"{len(sh.lanes)}, given {len(self.buffers)}")
        if r.push_constant_bytes != sh.push.size_bytes:
            raise E.DispatchError(f"{sh.variant}: push block is {r.push_constant_bytes} bytes in SPIR-V, "
                                  f"{sh.push.size_bytes} in abi.{sh.push.name}")
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
        # a fixed workgroup size, or the specialization constant local_size_x_id names
        self.local = self.spec[sh.decl.local] if isinstance(sh.decl.local, str) else sh.decl.local
        if not 1 <= self.local <= min(device.limit("max_compute_work_group_invocations"),
                                      device.limit("max_compute_work_group_size")[0]):
            raise E.DispatchError(f"{sh.variant}: workgroup size {self.local} exceeds the device's limits")
        self.groups = sh.groups(self.spec) if sh.spec_names else 1
        self.workgroups = workgroups_for(device, max_items * self.groups, self.groups, self.local)
        self.rows = min(int(rows), device.limit("max_compute_work_group_count")[1])
        if self.rows < 1:
            raise E.DispatchError(f"{sh.variant}: {rows} rows of workgroups")
        spec_arr = np.array([self.spec[n] for n in sh.spec_names], np.uint32)
        # Kompute takes the push-constant dtype from spec_consts: both uint32 (DESIGN.md).
        with device.guard(f"creating pipeline {sh.variant}"):
            self.algorithm = device.manager.algorithm(
                [b.tensor for b in self.buffers], code, [self.workgroups, self.rows, 1], spec_arr,
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
