"""The flash kernels' launch shape chosen by measurement on the device (GPUs).

attend_flash and attend_flash_coded take two free parameters: the workgroup size
(invocations) and how many workgroups an attention launches (splits × KV heads × head blocks);
attend_flash_coded a third, the query heads a workgroup serves (HB: its q·atom table and
atom weights take 2 · HB · n_atoms words of shared memory, so fewer heads mean more
workgroups resident per multiprocessor, each reading every V atom once at its end).
Which pair is fastest depends on the GPU (multiprocessors, registers, shared memory per
multiprocessor — Vulkan core reports none of the first two), on the layer's format and on
the context: the best workgroup size and count moved with the heads' shape and with n_used
(lab/NOTEBOOK.md, "Launch shapes and the tuner"). So the first attention over a layer in
each context bucket (n_used rounded up to a power of two) times every candidate pair on
the device's timestamps and keeps the fastest — per process, for every arena of the same
device and layer signature, so an engine pays it once per bucket (more on a layer's first:
every candidate's pipeline is compiled, unless the driver's own shader cache holds it from an
earlier process). With ``$KVDICT_VK_TUNE_CACHE`` naming a JSON file
the choices also outlive the process (kvdict_vk.vk.choice_store): a later one on the same
device, driver and SPIR-V — the layer signature holds all three — takes them from the file.

The candidate workgroup sizes (FLASH_LOCALS, FLASH_CODED_LOCALS) live here with the
candidate workgroup counts (workgroup_counts: whole multiples of the device's multiprocessors
where it reports them); kvdict_vk.vk.attend.flash keeps those a layer and the device allow, and
rounds a count's splits down, so an attention never launches more workgroups than its count.
CPU drivers (llvmpipe) do not tune: they do not plan the flash kernels by default, and
their fixed choice (the first size allowed) is what the tests pin.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .. import choice_store, shader_build

MIN_BUCKET = 1024
REPEATS = 2  # timed runs per candidate and round (the minimum is kept: noise only adds time)
ROUNDS = 3
WARM_S = 0.2  # untimed load before the candidates are timed: a GPU idling lowers its clocks
# workgroup sizes (invocations: attend_flash_coded's tokens per chunk; attend_flash spreads a
# token over head_dim / 8 of them), preferred first: the untuned choice is the first a layer
# and the device allow
FLASH_LOCALS = (256, 128)  # attend_flash
FLASH_CODED_LOCALS = (256, 128, 64)  # attend_flash_coded
# Workgroups per attention, preferred (untuned) first: multiples of the multiprocessors the
# device reports (vulkan_info's compute_units), so a count is whole waves of whole workgroups a
# multiprocessor; where it reports none, of UNREPORTED_UNITS (about a large GPU's: an H200 has
# 132). attend_flash_coded takes fewer (a larger fixed cost a workgroup: the q·atom table, the
# weights × atoms product). docs/DESIGN.md: "Launch shapes differ by shape", "Workgroup counts
# from the multiprocessors".
WORKGROUPS_PER_UNIT = (8, 2, 4)  # attend_flash
CODED_WORKGROUPS_PER_UNIT = (2, 1, 4)  # attend_flash_coded
UNREPORTED_UNITS = 128

# Bytes of scratch copied ahead of every timed run of a candidate (Attention.time_plan; outside
# the timed passes), pushing the L2's contents out as a decode step's other layers would — 0:
# the candidates run back to back, so a short context stays in the L2 between runs, which the
# benchmark (it flushes) does not see (docs/DESIGN.md: SmolLM2's shape at 8 k). Process-wide;
# part of what a choice is remembered under.
FLUSH_BYTES = 0

STORE_KIND = "attend_launch_shape"  # this tuner's choices in choice_store ($KVDICT_VK_TUNE_CACHE)
# the SPIR-V whose speed a choice measured (choice_store.device_identity: a rebuilt shader measures anew)
TUNED_VARIANTS = tuple(v for v in shader_build.VARIANTS if v.startswith("attend_"))

# signature(): (device name, driver, SPIR-V digest, layer format, n_kv, group, head_dim, n_atoms, bucket, FLUSH_BYTES) →
# (the candidate Shapes timed, the chosen (local, workgroups, heads, kernel))
_CHOICES: dict[tuple, tuple[tuple, tuple[int, int, int, str]]] = {}


def bucket(n_used: int) -> int:
    """The context bucket of n_used: the next power of two, at least MIN_BUCKET."""
    b = MIN_BUCKET
    while b < n_used:
        b *= 2
    return b


@dataclass(frozen=True)
class Shape:
    """One flash launch shape: invocations per workgroup, workgroups per attention, and over
    the codes query heads per workgroup (0: attend_flash, one KV head's group) and the kernel
    (flash.CODED_KERNELS over the codes, flash.FLASH_KERNELS over rows)."""
    local: int
    workgroups: int
    heads: int = 0
    kernel: str = "float"


def layer_signature(device, lay, group: int, layer: int) -> tuple:
    """What the launch shape of ``layer`` of layout ``lay`` depends on besides the context: the
    device, driver and SPIR-V (choice_store.device_identity), the streams' format, n_kv, the
    query heads per KV head (``group``), head_dim, n_atoms — fixed for an engine's life
    (kvdict_vk.vk.attend.flash.FlashShapes caches it per layer)."""
    k, v = lay.layers[layer].streams
    fmt = tuple((st.coded, st.sparsity, st.residual_bits, st.rows, st.n_dict_heads, st.key_rope is not None)
                for st in (k, v))
    return choice_store.device_identity(device, TUNED_VARIANTS) + (fmt, lay.n_kv_heads, group,
                                                                    lay.head_dim, lay.n_atoms)


def signature(layer_sig: tuple, n_used: int) -> tuple:
    """The key of a choice: the layer signature, the context bucket and how candidates are
    timed (FLUSH_BYTES)."""
    return layer_sig + (bucket(n_used), FLUSH_BYTES)


def workgroup_counts(compute_units: int, coded: bool) -> tuple[int, ...]:
    """The candidate workgroups per attention of attend_flash (or attend_flash_coded) on a
    device with ``compute_units`` multiprocessors (0: not reported), the untuned one first."""
    units = compute_units if compute_units > 0 else UNREPORTED_UNITS
    return tuple(units * m for m in (CODED_WORKGROUPS_PER_UNIT if coded else WORKGROUPS_PER_UNIT))


def candidates(options: list[tuple[int, list[int]]], counts: tuple[int, ...], kernel: str = "float") -> list[Shape]:
    """Every shape of ``options`` — [(query heads per workgroup, its workgroup sizes)], the
    default first (attend_flash: one entry, heads 0) — at every workgroup count of ``counts``
    (workgroup_counts), for ``kernel``."""
    return [Shape(n, w, heads, kernel) for heads, locals_ in options for n in locals_ for w in counts]


def choose(layer_sig: tuple, n_used: int, shapes: list[Shape], time_shape) -> Shape:
    """The fastest of ``shapes`` (candidates, the default first) for this (layer signature —
    device included —, bucket, candidates), measured on first use: ``time_shape(shape) ->
    seconds`` runs the attention over the layer at n_used in that shape (None when the device
    cannot time it: then the first candidate, untimed). A choice is remembered with the
    candidates it was among: other candidates (a kernel build changed within a process) are
    measured again."""
    key, offered = signature(layer_sig, n_used), tuple(shapes)
    if key in _CHOICES and _CHOICES[key][0] == offered:
        return Shape(*_CHOICES[key][1])
    stored = choice_store.load(STORE_KIND, key, _shape_list(offered))
    if stored is not None:
        _CHOICES[key] = (offered, tuple(stored))
        return Shape(*stored)
    first = shapes[0]
    t = time.perf_counter()
    while time.perf_counter() - t < WARM_S:  # the clocks up first (bench.timing.measure says why)
        if time_shape(first) is None:
            return first
    best_s = {shape: float("inf") for shape in shapes}
    for _ in range(ROUNDS):  # interleaved: a drifting clock hits every candidate alike
        for shape in shapes:
            seconds = time_shape(shape)
            if seconds is None:
                return first
            best_s[shape] = min(best_s[shape], seconds)
    best = min(shapes, key=lambda sh: best_s[sh])
    _CHOICES[key] = (offered, (best.local, best.workgroups, best.heads, best.kernel))
    choice_store.save(STORE_KIND, key, _shape_list(offered), list(_CHOICES[key][1]))
    return best


def _shape_list(shapes) -> list:
    return [[sh.local, sh.workgroups, sh.heads, sh.kernel] for sh in shapes]


def measured() -> dict:
    """What the tuner chose in this process (for reports): {signature: (local, workgroups, heads, kernel)}."""
    return {key: choice for key, (_, choice) in _CHOICES.items()}
