"""The flash kernels' launch shape chosen by measurement on the device (GPUs).

attend_flash and attend_flash_coded take two free parameters: the workgroup size
(invocations) and how many workgroups an attention launches (splits × KV heads × head blocks);
attend_flash_coded a third, the query heads a workgroup serves (HB: its q·atom table and
atom weights take 2 · HB · n_atoms words of shared memory, so fewer heads mean more
workgroups resident per multiprocessor, each reading every V atom once at its end).
Which pair is fastest depends on the GPU (multiprocessors, registers, shared memory per
multiprocessor — Vulkan core reports none of the first two), on the layer's format and on
the context: on an H200, 256-invocation workgroups won over 3 × 3 heads at 131 072 tokens
while 128-invocation ones won over 8 × 4 heads, and the best workgroup count moved with
n_used (one probe run, the session's closing note). So the first attention over a layer in
each context bucket (n_used rounded up to a power of two) times every candidate pair on
the device's timestamps and keeps the fastest — per process, for every arena of the same
device and layer signature, so an engine pays it once per bucket (0.2-0.5 s on an H200, and
1.4-3.9 s on a layer's first: every candidate's pipeline is made —
docs/results/h200/probes/attend_tune_store.json). With ``$KVDICT_VK_TUNE_CACHE`` naming a JSON file
the choices also outlive the process: a later one on the same device, driver and SPIR-V
(the layer signature holds all three: build_identity) takes them from the file instead of
timing again (load_stored / store).

The candidate workgroup sizes (FLASH_LOCALS, FLASH_CODED_LOCALS) live here with the
candidate workgroup counts; kvdict_vk.vk.attend keeps those a layer and the device allow.
CPU drivers (llvmpipe) do not tune: they do not plan the flash kernels by default, and
their fixed choice (the first size allowed) is what the tests pin.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl  # the store's lock (POSIX); without it, concurrent writers may drop a choice
except ImportError:  # pragma: no cover
    fcntl = None

from . import spirv

LOG = logging.getLogger(__name__)

MIN_BUCKET = 1024
REPEATS = 2  # timed runs per candidate and round (the minimum is kept: noise only adds time)
ROUNDS = 3
WARM_S = 0.2  # untimed load before the candidates are timed: a GPU idling lowers its clocks
# workgroup sizes (invocations: attend_flash_coded's tokens per chunk; attend_flash spreads a
# token over head_dim / 8 of them), preferred first: the untuned choice is the first a layer
# and the device allow
FLASH_LOCALS = (256, 128)  # attend_flash
FLASH_CODED_LOCALS = (256, 128, 64)  # attend_flash_coded
WORKGROUPS = (256, 512, 1024)  # attend_flash: workgroups per attention
CODED_WORKGROUPS = (132, 264, 528)  # attend_flash_coded (its fixed cost per workgroup is larger)

# Bytes of scratch copied ahead of every timed run of a candidate (Attention.time_plan; outside
# the timed passes), pushing the L2's contents out as a decode step's other layers would — 0:
# the candidates run back to back, so a short context stays in the L2 between runs, which the
# benchmark (it flushes) does not see (docs/DESIGN.md: SmolLM2's shape at 8 k). Process-wide;
# part of what a choice is remembered under.
FLUSH_BYTES = 0

# The JSON file choices are kept in across processes (unset or empty: in this process only).
CACHE_ENV = "KVDICT_VK_TUNE_CACHE"
STORE_VERSION = 1
# the SPIR-V whose speed a choice measured (build_identity: a rebuilt shader measures anew)
TUNED_VARIANTS = ("attend_flash", "attend_flash_sg", "attend_flash_wide", "attend_flash_wide_sg",
                  "attend_flash_coded", "attend_merge_head", "attend_table")

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
    (attend.CODED_KERNELS over the codes, attend.FLASH_KERNELS over rows)."""
    local: int
    workgroups: int
    heads: int = 0
    kernel: str = "float"


def build_identity(device) -> tuple:
    """(device name, driver, digest of the tuned kernels' SPIR-V): what else a choice's speed
    was measured on — a driver update or a rebuilt shader (``$KVDICT_VK_SPV_DIR`` included)
    is timed anew, in the process and in the store."""
    info = device.info
    return (device.name, f"{info.driver_name} {info.driver_info} {info.driver_version}".strip(),
            _spirv_digest(TUNED_VARIANTS, os.environ.get(spirv.SPV_DIR_ENV, "")))


@functools.lru_cache(maxsize=None)
def _spirv_digest(variants: tuple, spv_dir: str) -> str:
    """The tuned kernels' SPIR-V digest, read once per override directory (an engine asks once
    per layer)."""
    digest = hashlib.sha256()
    for variant in variants:
        digest.update(spirv.load(variant))
    return digest.hexdigest()[:16]


def layer_signature(att, layer: int) -> tuple:
    """What the launch shape of ``layer`` depends on besides the context: build_identity, the
    streams' format, n_kv, group, head_dim, n_atoms — fixed for an engine's life (Attention
    caches it per layer)."""
    lay = att.layout
    k, v = lay.layers[layer].streams
    fmt = tuple((st.coded, st.sparsity, st.residual_bits, st.rows, st.n_dict_heads) for st in (k, v))
    return build_identity(att.device) + (fmt, lay.n_kv_heads, att.group, lay.head_dim, lay.n_atoms)


def signature(layer_sig: tuple, n_used: int) -> tuple:
    """The key of a choice: the layer signature, the context bucket and how candidates are
    timed (FLUSH_BYTES)."""
    return layer_sig + (bucket(n_used), FLUSH_BYTES)


def candidates(options: list[tuple[int, list[int]]], coded: bool, kernel: str = "float") -> list[Shape]:
    """Every shape of ``options`` — [(query heads per workgroup, its workgroup sizes)], the
    default first (attend_flash: one entry, heads 0) — at every workgroup count, for ``kernel``."""
    return [Shape(n, w, heads, kernel) for heads, locals_ in options for n in locals_
            for w in (CODED_WORKGROUPS if coded else WORKGROUPS)]


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
    stored = load_stored(key, offered)
    if stored is not None:
        _CHOICES[key] = (offered, stored)
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
    store(key, offered, _CHOICES[key][1])
    return best


# --- the store: choices kept across processes ($KVDICT_VK_TUNE_CACHE) -----------------------
def store_path() -> Path | None:
    """The JSON file named by $KVDICT_VK_TUNE_CACHE (None: unset or empty, no store)."""
    name = os.environ.get(CACHE_ENV, "")
    return Path(name).expanduser() if name else None


def _entry_key(key: tuple) -> str:
    return json.dumps(key)  # tuples as lists: the signature holds strings, ints, bools and tuples


def _shape_list(shapes) -> list:
    return [[sh.local, sh.workgroups, sh.heads, sh.kernel] for sh in shapes]


def _read(f) -> dict:
    """The store's choices from an open file ({} when empty; a file that is not a store of
    this version is logged and read as empty — it is rewritten on the next store)."""
    f.seek(0)
    try:
        text = f.read()
        if not text.strip():
            return {}
        data = json.loads(text)
        if data.get("version") != STORE_VERSION or not isinstance(data.get("choices"), dict):
            raise ValueError(f"not a version-{STORE_VERSION} tuner store")
        return data["choices"]
    except (ValueError, AttributeError) as e:
        LOG.warning("%s: %s; measuring again and rewriting it", f.name, e)
        return {}


def load_stored(key: tuple, offered: tuple) -> tuple | None:
    """The stored choice for ``key`` if it was made among exactly ``offered`` (else None)."""
    path = store_path()
    if path is None or not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            entry = _read(f).get(_entry_key(key))
    except OSError as e:
        LOG.warning("%s: unreadable (%s); measuring", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("offered") != _shape_list(offered):
        return None
    choice = entry.get("choice")
    if not (isinstance(choice, list) and choice in _shape_list(offered)):
        return None  # a choice must be one of its candidates
    return tuple(choice)


def store(key: tuple, offered: tuple, choice: tuple) -> None:
    """Adds a choice to the store (a no-op without one), under an exclusive lock: read, add,
    rewrite — other processes' choices kept. A store that cannot be written is logged, not
    raised: the choice stands in this process."""
    path = store_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+", encoding="utf-8") as f:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)
            choices = _read(f)
            choices[_entry_key(key)] = {"offered": _shape_list(offered), "choice": list(choice)}
            f.seek(0)
            f.truncate()
            json.dump({"version": STORE_VERSION, "choices": choices}, f, indent=1, sort_keys=True)
            f.write("\n")
    except OSError as e:
        LOG.warning("%s: cannot store the tuner's choice (%s)", path, e)


def measured() -> dict:
    """What the tuner chose in this process (for reports): {signature: (local, workgroups, heads, kernel)}."""
    return {key: choice for key, (_, choice) in _CHOICES.items()}


def forget() -> None:
    """Drop every remembered choice (a probe timing several SPIR-V builds in one process:
    the candidates are the same, the kernels behind them not — attend_floor_probe --builds)."""
    _CHOICES.clear()
