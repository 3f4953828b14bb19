"""Loading the shipped SPIR-V, and just enough reflection to check a dispatch against it.

SPIR-V is package data (``kvdict_vk/spv/*.spv``) read with importlib.resources, so a wheel
needs no compiler. In a checkout (``shaders/`` next to the package) stale or missing
variants are rebuilt first, once per process. ``$KVDICT_VK_SPV_DIR`` names a directory
whose ``<variant>.spv`` files replace the shipped ones (read when a kernel is built, so a
process may time several directories side by side — lab/NOTEBOOK.md, Reconstruct's variants):
how an engine author tries a modified shader under kvdict-validate, and how the tests prove
that kvdict-validate catches a broken one.

The reflection reads the module itself — descriptor bindings (and each one's block name,
element width and writability), the push-constant block's size (and its members' offsets
and types), the specialization-constant IDs (and types), the workgroup size, capabilities and
extensions — so the Python-side checks compare a dispatch with what the shader really declares
(Kompute segfaults when a shader declares more bindings than it was given tensors).
"""
from __future__ import annotations

import functools
import importlib.resources
import os
import threading
from pathlib import Path
from dataclasses import dataclass

import numpy as np

from .. import errors as E
from . import abi, shader_build
from .vulkan_info import SUBGROUP_OPERATIONS

MAGIC = 0x07230203
# opcodes / enums used below (SPIR-V 1.x unified spec)
_OP_NAME, _OP_EXTENSION, _OP_EXECUTION_MODE, _OP_CAPABILITY = 5, 10, 16, 17
_OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_VECTOR, _OP_TYPE_STRUCT, _OP_TYPE_POINTER = 21, 22, 23, 30, 32
_OP_TYPE_RUNTIME_ARRAY, _OP_SPEC_CONSTANT_COMPOSITE = 29, 51
_OP_SPEC_CONSTANT = 50
_OP_VARIABLE, _OP_DECORATE, _OP_MEMBER_DECORATE = 59, 71, 72
_DEC_SPEC_ID, _DEC_ARRAY_STRIDE, _DEC_NON_WRITABLE, _DEC_BINDING, _DEC_SET, _DEC_OFFSET = 1, 6, 24, 33, 34, 35
_DEC_BUILTIN, _BUILTIN_WORKGROUP_SIZE = 11, 25
_SC_UNIFORM, _SC_PUSH_CONSTANT, _SC_STORAGE_BUFFER = 2, 9, 12
_MODE_LOCAL_SIZE, _CAP_SHADER = 17, 1

SPV_DIR_ENV = "KVDICT_VK_SPV_DIR"
_BUILD_LOCK = threading.Lock()
_built = False


@dataclass(frozen=True)
class Reflection:
    bindings: tuple  # sorted (set, binding) of the storage buffers
    push_constant_bytes: int
    spec_ids: tuple  # sorted SpecId decorations
    local_size: tuple
    capabilities: tuple
    extensions: tuple
    # per binding, in ``bindings`` order: (block name, words per element of its runtime
    # array — 4 for vec4/uvec4 —, whether any member is writable)
    buffers: tuple = ()
    local_size_spec_id: int | None = None  # the SpecId that sets local_size_x (local_size_x_id), if any
    # the push-constant block: its struct name, and per member (declaration order) its
    # (byte offset, size in bytes, scalar type: "uint32", "int32", "float32", …)
    push_block: str = ""
    push_members: tuple = ()
    spec_types: tuple = ()  # per SpecId in spec_ids order: its scalar type ("uint32", …; "bool")


def _ensure_built() -> None:
    """In a checkout, rebuild stale SPIR-V once per process; installed wheels ship it."""
    global _built
    with _BUILD_LOCK:
        if not _built and shader_build.in_checkout():
            shader_build.build()
        _built = True


def load(name: str) -> bytes:
    """The SPIR-V bytes of a shader variant (see shader_build.VARIANTS), from
    ``$KVDICT_VK_SPV_DIR`` where it holds the variant, else the shipped build."""
    # Read at every call (a few KiB, beside a pipeline's creation): a cache keyed by the name
    # kept serving the first directory's module after the override changed, so a variants
    # probe timed one shader under several names.
    if name not in shader_build.VARIANTS:
        raise E.ShaderBuildError(f"unknown shader variant {name!r}")
    override = os.environ.get(SPV_DIR_ENV)
    if override and (Path(override) / f"{name}.spv").is_file():
        data = (Path(override) / f"{name}.spv").read_bytes()
        if len(data) < 20 or len(data) % 4 or int.from_bytes(data[:4], "little") != MAGIC:
            raise E.ShaderBuildError(f"{override}/{name}.spv (${SPV_DIR_ENV}) is not a SPIR-V module")
        return data
    _ensure_built()
    try:
        data = (importlib.resources.files("kvdict_vk") / "spv" / f"{name}.spv").read_bytes()
    except (FileNotFoundError, OSError) as e:
        raise E.ShaderBuildError(f"SPIR-V for {name} not found ({e}); build it with "
                                 f"`python -m kvdict_vk.vk.shader_build`") from e
    if len(data) < 20 or len(data) % 4 or int.from_bytes(data[:4], "little") != MAGIC:
        raise E.ShaderBuildError(f"{name}.spv is not a SPIR-V module")
    return data


def _string(words: np.ndarray) -> str:
    raw = words.astype("<u4").tobytes()
    return raw.split(b"\0", 1)[0].decode()


@functools.lru_cache(maxsize=None)
def reflect(spirv: bytes) -> Reflection:
    w = np.frombuffer(spirv, "<u4")
    ints, floats, vectors, pointers, structs = {}, {}, {}, {}, {}
    decor, member_offsets, variables = {}, {}, []
    names, runtime_arrays, non_writable, spec_composites = {}, {}, {}, {}
    signed, spec_type_of = {}, {}  # int type id → signedness; spec constant id → its type id
    local_size, caps, exts = (1, 1, 1), [], []
    i = 5  # header: magic, version, generator, bound, schema
    while i < len(w):
        op, count = int(w[i]) & 0xFFFF, int(w[i]) >> 16
        if count == 0 or i + count > len(w):
            raise E.ShaderBuildError("malformed SPIR-V instruction stream")
        a = [int(x) for x in w[i + 1:i + count]]
        if op == _OP_CAPABILITY:
            caps.append(a[0])
        elif op == _OP_NAME:
            names[a[0]] = _string(w[i + 2:i + count])
        elif op == _OP_TYPE_RUNTIME_ARRAY:
            runtime_arrays[a[0]] = a[1]
        elif op == _OP_SPEC_CONSTANT_COMPOSITE:
            spec_composites[a[1]] = a[2:]
        elif op == _OP_EXTENSION:
            exts.append(_string(w[i + 1:i + count]))
        elif op == _OP_EXECUTION_MODE and a[1] == _MODE_LOCAL_SIZE:
            local_size = tuple(a[2:5])
        elif op == _OP_SPEC_CONSTANT:
            spec_type_of[a[1]] = a[0]
        elif op in (48, 49):  # OpSpecConstantTrue / False
            spec_type_of[a[1]] = None
        elif op == _OP_TYPE_INT or op == _OP_TYPE_FLOAT:
            if op == _OP_TYPE_INT:
                signed[a[0]] = a[2]
            (ints if op == _OP_TYPE_INT else floats)[a[0]] = a[1] // 8
        elif op == _OP_TYPE_VECTOR:
            vectors[a[0]] = (a[1], a[2])
        elif op == _OP_TYPE_STRUCT:
            structs[a[0]] = a[1:]
        elif op == _OP_TYPE_POINTER:
            pointers[a[0]] = (a[1], a[2])
        elif op == _OP_VARIABLE:
            variables.append((a[1], a[0], a[2]))  # (id, pointer type, storage class)
        elif op == _OP_DECORATE:
            decor.setdefault(a[0], {})[a[1]] = a[2] if len(a) > 2 else True
        elif op == _OP_MEMBER_DECORATE and a[2] == _DEC_OFFSET:
            member_offsets.setdefault(a[0], {})[a[1]] = a[3]
        elif op == _OP_MEMBER_DECORATE and a[2] == _DEC_NON_WRITABLE:
            non_writable.setdefault(a[0], set()).add(a[1])
        i += count

    def size_of(t: int) -> int:
        if t in ints or t in floats:
            return ints.get(t) or floats[t]
        if t in vectors:
            return size_of(vectors[t][0]) * vectors[t][1]
        raise E.ShaderBuildError(f"push-constant member of unsupported type (id {t})")

    def buffer_of(ptr: int) -> tuple:
        struct = pointers[ptr][1]
        members = structs.get(struct, [])
        last = members[-1] if members else None
        stride = decor.get(last, {}).get(_DEC_ARRAY_STRIDE, 0) if last in runtime_arrays else 0
        writable = any(m not in non_writable.get(struct, set()) for m in range(len(members)))
        return names.get(struct, ""), stride // 4, writable

    def scalar_name(t) -> str:
        if t is None:
            return "bool"
        if t in vectors:
            return f"{scalar_name(vectors[t][0])}x{vectors[t][1]}"
        kind = "float" if t in floats else ("int" if signed.get(t) else "uint")
        return f"{kind}{size_of(t) * 8}"

    bindings, buffers, push_bytes, push_block, push_members = [], {}, 0, "", ()
    for var, ptr, sc in variables:
        if sc in (_SC_STORAGE_BUFFER, _SC_UNIFORM) and _DEC_BINDING in decor.get(var, {}):
            key = (decor[var].get(_DEC_SET, 0), decor[var][_DEC_BINDING])
            bindings.append(key)
            buffers[key] = buffer_of(ptr)
        elif sc == _SC_PUSH_CONSTANT:
            struct = pointers[ptr][1]
            offsets = member_offsets.get(struct, {})
            push_bytes = max((offsets[m] + size_of(t) for m, t in enumerate(structs[struct])), default=0)
            push_block = names.get(struct, "")
            push_members = tuple((offsets[m], size_of(t), scalar_name(t)) for m, t in enumerate(structs[struct]))
    spec_ids = sorted(d[_DEC_SPEC_ID] for d in decor.values() if _DEC_SPEC_ID in d)
    spec_types = {d[_DEC_SPEC_ID]: scalar_name(spec_type_of[t]) for t, d in decor.items()
                  if _DEC_SPEC_ID in d and t in spec_type_of}
    local_id = None
    for target, d in decor.items():
        if d.get(_DEC_BUILTIN) == _BUILTIN_WORKGROUP_SIZE and target in spec_composites:
            local_id = decor.get(spec_composites[target][0], {}).get(_DEC_SPEC_ID)
    return Reflection(tuple(sorted(bindings)), push_bytes, tuple(spec_ids), local_size,
                      tuple(caps), tuple(exts), tuple(buffers[k] for k in sorted(bindings)), local_id,
                      push_block, push_members, tuple(spec_types.get(i, "") for i in spec_ids))


# SPIR-V's GroupNonUniform* capabilities (61 … 68) by the Vulkan subgroup operation class
# that allows each: the same order as VkSubgroupFeatureFlagBits' bits
SUBGROUP_CAPABILITIES = {61 + bit: name for bit, name in enumerate(SUBGROUP_OPERATIONS)}


def check_portable(name: str, r: Reflection, max_invocations: int = 128, subgroup_ops: tuple = (),
                   features: tuple = ()) -> None:
    """Shader rules: Shader capability only — and the subgroup capabilities of the operation
    classes ``subgroup_ops``, the capabilities and extensions of the optional ``features``
    (abi.FEATURE_CAPABILITIES; a variant that declares them, for devices that report them) —,
    ≤ 128 invocations, set 0."""
    allowed = {_CAP_SHADER} | {c for c, op in SUBGROUP_CAPABILITIES.items() if op in subgroup_ops}
    allowed |= {c for f in features for c in abi.FEATURE_CAPABILITIES[f][0]}
    if set(r.capabilities) - allowed:
        raise E.ShaderBuildError(f"{name}: needs capabilities {r.capabilities} (allowed: {sorted(allowed)})")
    if set(r.extensions) - {x for f in features for x in abi.FEATURE_CAPABILITIES[f][1]}:
        raise E.ShaderBuildError(f"{name}: needs SPIR-V extensions {r.extensions}")
    if int(np.prod(r.local_size)) > max_invocations:
        raise E.ShaderBuildError(f"{name}: workgroup {r.local_size} exceeds {max_invocations} invocations")
    if any(s != 0 for s, _ in r.bindings) or [b for _, b in r.bindings] != list(range(len(r.bindings))):
        raise E.ShaderBuildError(f"{name}: bindings {r.bindings} are not set 0, bindings 0..n-1")
