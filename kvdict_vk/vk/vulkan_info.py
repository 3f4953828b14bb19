"""Physical-device facts Kompute does not expose, read straight from the Vulkan loader.

Kompute's Python binding reports a device name and workgroup limits only; the arena also
needs maxStorageBufferRange, maxMemoryAllocationSize, the memory heaps and the device type
(to refuse arenas before allocating, and to pick a CPU- or GPU-friendly shader mapping), and
the subgroup size and operations of compute shaders (to pick the kernel variants that use
subgroup shuffles where the device has them), and — where NVIDIA's or AMD's extensions report
it — the multiprocessor count (compute_units; diagnostics for now).
This module asks the loader through ``ctypes`` (a short-lived instance of its own, no kp),
enumerating devices in the loader's order — the order ``kp.Manager(index)`` uses.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import asdict, dataclass, field

from .. import errors as E

_u32, _i32, _u64, _f32, _u8 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_float, ctypes.c_uint8
_size_t = ctypes.c_size_t

# VkPhysicalDeviceLimits, field for field (vulkan_core.h); (name, ctype[, count]).
_LIMITS = [
    *[(n, _u32) for n in (
        "maxImageDimension1D maxImageDimension2D maxImageDimension3D maxImageDimensionCube "
        "maxImageArrayLayers maxTexelBufferElements maxUniformBufferRange maxStorageBufferRange "
        "maxPushConstantsSize maxMemoryAllocationCount maxSamplerAllocationCount").split()],
    ("bufferImageGranularity", _u64), ("sparseAddressSpaceSize", _u64),
    *[(n, _u32) for n in (
        "maxBoundDescriptorSets maxPerStageDescriptorSamplers maxPerStageDescriptorUniformBuffers "
        "maxPerStageDescriptorStorageBuffers maxPerStageDescriptorSampledImages "
        "maxPerStageDescriptorStorageImages maxPerStageDescriptorInputAttachments maxPerStageResources "
        "maxDescriptorSetSamplers maxDescriptorSetUniformBuffers maxDescriptorSetUniformBuffersDynamic "
        "maxDescriptorSetStorageBuffers maxDescriptorSetStorageBuffersDynamic maxDescriptorSetSampledImages "
        "maxDescriptorSetStorageImages maxDescriptorSetInputAttachments maxVertexInputAttributes "
        "maxVertexInputBindings maxVertexInputAttributeOffset maxVertexInputBindingStride "
        "maxVertexOutputComponents maxTessellationGenerationLevel maxTessellationPatchSize "
        "maxTessellationControlPerVertexInputComponents maxTessellationControlPerVertexOutputComponents "
        "maxTessellationControlPerPatchOutputComponents maxTessellationControlTotalOutputComponents "
        "maxTessellationEvaluationInputComponents maxTessellationEvaluationOutputComponents "
        "maxGeometryShaderInvocations maxGeometryInputComponents maxGeometryOutputComponents "
        "maxGeometryOutputVertices maxGeometryTotalOutputComponents maxFragmentInputComponents "
        "maxFragmentOutputAttachments maxFragmentDualSrcAttachments maxFragmentCombinedOutputResources "
        "maxComputeSharedMemorySize").split()],
    ("maxComputeWorkGroupCount", _u32, 3), ("maxComputeWorkGroupInvocations", _u32),
    ("maxComputeWorkGroupSize", _u32, 3),
    *[(n, _u32) for n in ("subPixelPrecisionBits subTexelPrecisionBits mipmapPrecisionBits "
                          "maxDrawIndexedIndexValue maxDrawIndirectCount").split()],
    ("maxSamplerLodBias", _f32), ("maxSamplerAnisotropy", _f32), ("maxViewports", _u32),
    ("maxViewportDimensions", _u32, 2), ("viewportBoundsRange", _f32, 2),
    ("viewportSubPixelBits", _u32), ("minMemoryMapAlignment", _size_t),
    ("minTexelBufferOffsetAlignment", _u64), ("minUniformBufferOffsetAlignment", _u64),
    ("minStorageBufferOffsetAlignment", _u64), ("minTexelOffset", _i32), ("maxTexelOffset", _u32),
    ("minTexelGatherOffset", _i32), ("maxTexelGatherOffset", _u32),
    ("minInterpolationOffset", _f32), ("maxInterpolationOffset", _f32),
    *[(n, _u32) for n in (
        "subPixelInterpolationOffsetBits maxFramebufferWidth maxFramebufferHeight maxFramebufferLayers "
        "framebufferColorSampleCounts framebufferDepthSampleCounts framebufferStencilSampleCounts "
        "framebufferNoAttachmentsSampleCounts maxColorAttachments sampledImageColorSampleCounts "
        "sampledImageIntegerSampleCounts sampledImageDepthSampleCounts sampledImageStencilSampleCounts "
        "storageImageSampleCounts maxSampleMaskWords timestampComputeAndGraphics").split()],
    ("timestampPeriod", _f32),
    *[(n, _u32) for n in ("maxClipDistances maxCullDistances maxCombinedClipAndCullDistances "
                          "discreteQueuePriorities").split()],
    ("pointSizeRange", _f32, 2), ("lineWidthRange", _f32, 2), ("pointSizeGranularity", _f32),
    ("lineWidthGranularity", _f32), ("strictLines", _u32), ("standardSampleLocations", _u32),
    ("optimalBufferCopyOffsetAlignment", _u64), ("optimalBufferCopyRowPitchAlignment", _u64),
    ("nonCoherentAtomSize", _u64),
]


class _Limits(ctypes.Structure):
    _fields_ = [(f[0], f[1] * f[2]) if len(f) == 3 else f for f in _LIMITS]


class _Properties(ctypes.Structure):
    _fields_ = [("apiVersion", _u32), ("driverVersion", _u32), ("vendorID", _u32), ("deviceID", _u32),
                ("deviceType", _i32), ("deviceName", ctypes.c_char * 256), ("pipelineCacheUUID", _u8 * 16),
                ("limits", _Limits), ("sparseProperties", _u32 * 5)]


class _Properties2(ctypes.Structure):
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("properties", _Properties)]


class _Maintenance3(ctypes.Structure):
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("maxPerSetDescriptors", _u32),
                ("maxMemoryAllocationSize", _u64)]


class _DriverProps(ctypes.Structure):
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("driverID", _i32),
                ("driverName", ctypes.c_char * 256), ("driverInfo", ctypes.c_char * 256),
                ("conformanceVersion", _u8 * 4)]


class _SmBuiltinsNV(ctypes.Structure):  # VK_NV_shader_sm_builtins
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("shaderSMCount", _u32), ("shaderWarpsPerSM", _u32)]


class _ShaderCoreAMD(ctypes.Structure):  # VK_AMD_shader_core_properties (the first three fields used)
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("shaderEngineCount", _u32),
                ("shaderArraysPerEngineCount", _u32), ("computeUnitsPerShaderArray", _u32), ("rest", _u32 * 11)]


class _Features2(ctypes.Structure):  # VkPhysicalDeviceFeatures2: the 55 core VkBool32s, unread
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("features", _u32 * 55)]


def _bools(name: str, fields: str):
    """A VkPhysicalDevice*Features struct: sType, pNext, then VkBool32 ``fields``."""
    return type(name, (ctypes.Structure,), {"_fields_": [("sType", _i32), ("pNext", ctypes.c_void_p)]
                                                        + [(f, _u32) for f in fields.split()]})


# The optional features a kernel variant may need (abi.FEATURES), as Vulkan reports them: per
# name, the device extensions it needs (Kompute's instance is Vulkan 1.1, so features promoted
# to 1.2/1.3 come through their extensions), and the feature structs' (sType, VkBool32 fields,
# the fields that must all be set). scripts/kp_patch.py enables the same at device creation.
_FEATURE_STRUCTS = {
    "16bit_storage": (1000083000, "storageBuffer16BitAccess uniformAndStorageBuffer16BitAccess "
                                  "storagePushConstant16 storageInputOutput16"),
    "float16_int8": (1000082000, "shaderFloat16 shaderInt8"),
    "8bit_storage": (1000177000, "storageBuffer8BitAccess uniformAndStorageBuffer8BitAccess storagePushConstant8"),
    "integer_dot": (1000280000, "shaderIntegerDotProduct"),
    "cooperative_matrix_nv": (1000249000, "cooperativeMatrix cooperativeMatrixRobustBufferAccess"),
    "vulkan_memory_model": (1000211000, "vulkanMemoryModel vulkanMemoryModelDeviceScope "
                                        "vulkanMemoryModelAvailabilityVisibilityChains"),
    "atomic_float": (1000260000, "shaderBufferFloat32Atomics shaderBufferFloat32AtomicAdd shaderBufferFloat64Atomics "
                                 "shaderBufferFloat64AtomicAdd shaderSharedFloat32Atomics shaderSharedFloat32AtomicAdd "
                                 "shaderSharedFloat64Atomics shaderSharedFloat64AtomicAdd shaderImageFloat32Atomics "
                                 "shaderImageFloat32AtomicAdd sparseImageFloat32Atomics sparseImageFloat32AtomicAdd"),
}
# struct → the device extension that must be present to chain it (None: core in Vulkan 1.1)
_STRUCT_EXTENSION = {"16bit_storage": None, "float16_int8": "VK_KHR_shader_float16_int8",
                     "8bit_storage": "VK_KHR_8bit_storage", "integer_dot": "VK_KHR_shader_integer_dot_product",
                     "atomic_float": "VK_EXT_shader_atomic_float",
                     "cooperative_matrix_nv": "VK_NV_cooperative_matrix",
                     "vulkan_memory_model": "VK_KHR_vulkan_memory_model"}
# abi.FEATURES name → the (struct, field) pairs it needs, all set (cooperative_matrix_nv also
# needs the shape its variants use among the driver's: COOPMAT_NV_SHAPE; cooperative_matrix,
# the KHR extension: reported by its extension, below)
FEATURE_NEEDS = {
    "float16": (("float16_int8", "shaderFloat16"), ("16bit_storage", "storageBuffer16BitAccess")),
    "int8": (("float16_int8", "shaderInt8"), ("8bit_storage", "storageBuffer8BitAccess")),
    "integer_dot": (("integer_dot", "shaderIntegerDotProduct"),),
    "float_atomics": (("atomic_float", "shaderBufferFloat32AtomicAdd"),
                      ("atomic_float", "shaderSharedFloat32AtomicAdd")),
    # glslang builds GL_NV_cooperative_matrix under the Vulkan memory model (abi.FEATURE_CAPABILITIES)
    "cooperative_matrix_nv": (("cooperative_matrix_nv", "cooperativeMatrix"),
                              ("vulkan_memory_model", "vulkanMemoryModel")),
}
# The one cooperative-matrix shape the attend_mma variants use (GL_NV_cooperative_matrix, subgroup
# scope): (M, N, K, A, B, C, D types) — 16×16 binary16 times 16×8 binary16 into 16×8 float32.
COOPMAT_NV_SHAPE = (16, 8, 16, "f16", "f16", "f32", "f32")
_COMPONENT_NV = {0: "f16", 1: "f32", 2: "f64", 3: "i8", 4: "i16", 5: "i32", 6: "i64", 7: "u8", 8: "u16", 9: "u32",
                 10: "u64"}
_SCOPE_SUBGROUP_NV = 3


class _CoopMatPropsNV(ctypes.Structure):  # VkCooperativeMatrixPropertiesNV
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("MSize", _u32), ("NSize", _u32), ("KSize", _u32),
                ("AType", _i32), ("BType", _i32), ("CType", _i32), ("DType", _i32), ("scope", _i32)]


def _coopmat_nv_shapes(vk, instance, handle) -> tuple:
    """The subgroup-scope shapes vkGetPhysicalDeviceCooperativeMatrixPropertiesNV reports, as
    (M, N, K, A, B, C, D types) (empty where the loader has no such function)."""
    proto = ctypes.CFUNCTYPE(_i32, ctypes.c_void_p, ctypes.POINTER(_u32), ctypes.c_void_p)
    vk.vkGetInstanceProcAddr.restype = ctypes.c_void_p
    addr = vk.vkGetInstanceProcAddr(instance, b"vkGetPhysicalDeviceCooperativeMatrixPropertiesNV")
    if not addr:
        return ()
    get = proto(addr)
    count = _u32(0)
    get(ctypes.c_void_p(handle), ctypes.byref(count), None)
    props = (_CoopMatPropsNV * count.value)(*[_CoopMatPropsNV(1000249001, None) for _ in range(count.value)])
    get(ctypes.c_void_p(handle), ctypes.byref(count), props)
    name = lambda t: _COMPONENT_NV.get(t, str(t))  # noqa: E731
    return tuple(sorted({(p.MSize, p.NSize, p.KSize, name(p.AType), name(p.BType), name(p.CType), name(p.DType))
                         for p in props[:count.value] if p.scope == _SCOPE_SUBGROUP_NV}))
_ST_FEATURES2 = 1000059000


def _optional_features(vk, handle, exts: set, coopmat_nv_shapes: tuple = ()) -> tuple[str, ...]:
    """The abi.FEATURES names the device reports every part of (vkGetPhysicalDeviceFeatures2;
    cooperative_matrix_nv: with COOPMAT_NV_SHAPE among ``coopmat_nv_shapes``)."""
    structs = {name: _bools(f"_{name}", fields)(st) for name, (st, fields) in _FEATURE_STRUCTS.items()
               if _STRUCT_EXTENSION[name] is None or _STRUCT_EXTENSION[name] in exts}
    feats = _Features2(_ST_FEATURES2, None)
    tail = feats
    for s in structs.values():
        tail.pNext = ctypes.cast(ctypes.pointer(s), ctypes.c_void_p)
        tail = s
    vk.vkGetPhysicalDeviceFeatures2(ctypes.c_void_p(handle), ctypes.byref(feats))
    have = [name for name, needs in FEATURE_NEEDS.items()
            if all(st in structs and getattr(structs[st], f) for st, f in needs)
            and (name != "cooperative_matrix_nv" or COOPMAT_NV_SHAPE in coopmat_nv_shapes)]
    # cooperative matrices (KHR): reported by their extension (its feature struct is newer than
    # Debian 12's validation layer, which flags it in a chain, and Debian 12's glslang cannot
    # build GL_KHR_cooperative_matrix); not enabled (kp_patch). The NV extension serves instead.
    return tuple(have + (["cooperative_matrix"] if "VK_KHR_cooperative_matrix" in exts else []))


class _ExtensionProps(ctypes.Structure):
    _fields_ = [("extensionName", ctypes.c_char * 256), ("specVersion", _u32)]


class _SubgroupProps(ctypes.Structure):
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("subgroupSize", _u32), ("supportedStages", _u32),
                ("supportedOperations", _u32), ("quadOperationsInAllStages", _u32)]


class _MemoryProps(ctypes.Structure):
    _fields_ = [("memoryTypeCount", _u32), ("memoryTypes", _u32 * 64),  # 32 × (flags, heapIndex)
                ("memoryHeapCount", _u32), ("memoryHeaps", _u64 * 32)]  # 16 × (size, flags+pad)


class _QueueFamily(ctypes.Structure):
    _fields_ = [("queueFlags", ctypes.c_uint32), ("queueCount", ctypes.c_uint32),
                ("timestampValidBits", ctypes.c_uint32), ("granularity", ctypes.c_uint32 * 3)]


_QUEUE_COMPUTE = 0x2


class _AppInfo(ctypes.Structure):
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                ("applicationVersion", _u32), ("pEngineName", ctypes.c_char_p),
                ("engineVersion", _u32), ("apiVersion", _u32)]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", _i32), ("pNext", ctypes.c_void_p), ("flags", _u32),
                ("pApplicationInfo", ctypes.POINTER(_AppInfo)), ("enabledLayerCount", _u32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", _u32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


_ST_APP, _ST_INSTANCE = 0, 1
_ST_PROPS2, _ST_MAINT3, _ST_DRIVER, _ST_SUBGROUP = 1000059001, 1000168000, 1000196000, 1000094000
_ST_SM_BUILTINS_NV, _ST_SHADER_CORE_AMD = 1000154001, 1000185000
_STAGE_COMPUTE = 0x20
# VkSubgroupFeatureFlagBits, bit by bit
SUBGROUP_OPERATIONS = ("basic", "vote", "arithmetic", "ballot", "shuffle", "shuffle_relative", "clustered", "quad")
_DEVICE_TYPES = {0: "other", 1: "integrated-gpu", 2: "discrete-gpu", 3: "virtual-gpu", 4: "cpu"}
_HEAP_DEVICE_LOCAL = 1


def _version(v: int) -> str:
    return f"{v >> 22 & 0x7F}.{v >> 12 & 0x3FF}.{v & 0xFFF}"


def _make_version(major: int, minor: int) -> int:
    return major << 22 | minor << 12


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    device_type: str  # "cpu", "discrete-gpu", "integrated-gpu", "virtual-gpu", "other"
    vendor_id: int
    device_id: int
    api_version: str
    driver_version: int  # vendor-specific encoding, reported raw
    driver_name: str  # "" before Vulkan 1.2
    driver_info: str
    limits: dict = field(default_factory=dict)
    heaps: tuple = ()  # ((size bytes, device_local), …)

    @property
    def device_local_bytes(self) -> int:
        local = [s for s, dl in self.heaps if dl]
        return max(local or [s for s, _ in self.heaps] or [0])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["heaps"] = [{"bytes": s, "device_local": dl} for s, dl in self.heaps]
        return d


def _load_loader():
    names = {"win32": ["vulkan-1.dll"], "darwin": ["libvulkan.1.dylib", "libMoltenVK.dylib"]}
    for name in names.get(sys.platform, ["libvulkan.so.1", "libvulkan.so"]):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise E.DeviceNotFoundError("no Vulkan loader (libvulkan) found")


def query_devices() -> list[DeviceInfo]:
    """Every physical device the loader reports, in enumeration order."""
    vk = _load_loader()
    inst_version = _u32(_make_version(1, 0))
    if hasattr(vk, "vkEnumerateInstanceVersion"):
        vk.vkEnumerateInstanceVersion(ctypes.byref(inst_version))
    api = _make_version(1, 2) if inst_version.value >= _make_version(1, 2) else _make_version(1, 1)
    app = _AppInfo(_ST_APP, None, b"kvdict_vk", 1, b"kvdict_vk", 1, api)
    create = _InstanceInfo(_ST_INSTANCE, None, 0, ctypes.pointer(app), 0, None, 0, None)
    instance = ctypes.c_void_p()
    res = vk.vkCreateInstance(ctypes.byref(create), None, ctypes.byref(instance))
    if res != 0:
        raise E.DeviceNotFoundError(f"vkCreateInstance failed (VkResult {res})")
    try:
        count = _u32(0)
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        return [_describe(vk, instance, i, h, api) for i, h in enumerate(handles[:count.value])]
    finally:
        vk.vkDestroyInstance(instance, None)


def _extensions(vk, handle) -> set[str]:
    """The device extensions the driver reports."""
    count = _u32(0)
    vk.vkEnumerateDeviceExtensionProperties(ctypes.c_void_p(handle), None, ctypes.byref(count), None)
    props = (_ExtensionProps * count.value)()
    vk.vkEnumerateDeviceExtensionProperties(ctypes.c_void_p(handle), None, ctypes.byref(count), props)
    return {e.extensionName.decode(errors="replace") for e in props[:count.value]}


def _describe(vk, instance, index: int, handle, instance_api: int) -> DeviceInfo:
    base = _Properties()
    vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handle), ctypes.byref(base))
    # the chain: maintenance3 → subgroup properties (core in 1.1) → driver properties (1.2)
    maint3 = _Maintenance3(_ST_MAINT3, None, 0, 0)
    subgroup = _SubgroupProps(_ST_SUBGROUP, None)
    driver = _DriverProps(_ST_DRIVER, None)
    if base.apiVersion >= _make_version(1, 1):
        maint3.pNext = ctypes.cast(ctypes.pointer(subgroup), ctypes.c_void_p)
    have_driver = base.apiVersion >= _make_version(1, 2) and instance_api >= _make_version(1, 2)
    if have_driver:  # a 1.2 device is a 1.1 device: the subgroup properties are chained
        subgroup.pNext = ctypes.cast(ctypes.pointer(driver), ctypes.c_void_p)
    # the multiprocessors (compute units): Vulkan core does not report them; NVIDIA's and AMD's
    # extensions do (0: unknown). Reported (kvdict-validate --list); the flash tuner's workgroup
    # counts do not use them yet (docs/DESIGN.md, "Launch shapes differ by shape")
    exts = _extensions(vk, handle) if base.apiVersion >= _make_version(1, 1) else set()
    sm_nv = _SmBuiltinsNV(_ST_SM_BUILTINS_NV, None, 0, 0)
    core_amd = _ShaderCoreAMD(_ST_SHADER_CORE_AMD, None)
    tail = driver if have_driver else subgroup
    for ext, struct in (("VK_NV_shader_sm_builtins", sm_nv), ("VK_AMD_shader_core_properties", core_amd)):
        if ext in exts:
            tail.pNext = ctypes.cast(ctypes.pointer(struct), ctypes.c_void_p)
            tail = struct
    props2 = _Properties2(_ST_PROPS2, ctypes.cast(ctypes.pointer(maint3), ctypes.c_void_p))
    vk.vkGetPhysicalDeviceProperties2(ctypes.c_void_p(handle), ctypes.byref(props2))
    mem = _MemoryProps()
    vk.vkGetPhysicalDeviceMemoryProperties(ctypes.c_void_p(handle), ctypes.byref(mem))
    n_families = _u32(0)
    vk.vkGetPhysicalDeviceQueueFamilyProperties(ctypes.c_void_p(handle), ctypes.byref(n_families), None)
    families = (_QueueFamily * n_families.value)()
    vk.vkGetPhysicalDeviceQueueFamilyProperties(ctypes.c_void_p(handle), ctypes.byref(n_families), families)
    # Kompute submits to the first family with compute: its timestamps are the ones we read
    compute = [f for f in families if f.queueFlags & _QUEUE_COMPUTE]
    lim = base.limits
    coopmat_nv = _coopmat_nv_shapes(vk, instance, handle) if "VK_NV_cooperative_matrix" in exts else ()
    limits = {
        "max_storage_buffer_range": lim.maxStorageBufferRange,
        "max_memory_allocation_size": maint3.maxMemoryAllocationSize,
        "max_push_constants_size": lim.maxPushConstantsSize,
        "max_per_stage_storage_buffers": lim.maxPerStageDescriptorStorageBuffers,
        "max_compute_shared_memory_size": lim.maxComputeSharedMemorySize,
        "max_compute_work_group_count": tuple(lim.maxComputeWorkGroupCount),
        "max_compute_work_group_invocations": lim.maxComputeWorkGroupInvocations,
        "max_compute_work_group_size": tuple(lim.maxComputeWorkGroupSize),
        "min_storage_buffer_offset_alignment": lim.minStorageBufferOffsetAlignment,
        "timestamp_compute_and_graphics": bool(lim.timestampComputeAndGraphics),
        "timestamp_period_ns": lim.timestampPeriod,
        "timestamp_valid_bits": compute[0].timestampValidBits if compute else 0,
        # subgroups in compute shaders: their size and the operation classes they support
        # (none when the compute stage has no subgroup support)
        "subgroup_size": subgroup.subgroupSize,
        "subgroup_operations": tuple(name for bit, name in enumerate(SUBGROUP_OPERATIONS)
                                     if subgroup.supportedStages & _STAGE_COMPUTE
                                     and subgroup.supportedOperations >> bit & 1),
        "compute_units": sm_nv.shaderSMCount or (core_amd.shaderEngineCount * core_amd.shaderArraysPerEngineCount
                                                 * core_amd.computeUnitsPerShaderArray),
        # cooperative-matrix shapes (VK_NV_cooperative_matrix, subgroup scope): (M, N, K, types)
        "cooperative_matrix_nv_shapes": coopmat_nv,
        # optional features beyond Vulkan 1.1 core compute that a variant may need (abi.FEATURES)
        "optional_features": (_optional_features(vk, handle, exts, coopmat_nv)
                              if base.apiVersion >= _make_version(1, 1) else ()),
    }
    heaps = tuple((int(mem.memoryHeaps[2 * i]), bool(mem.memoryHeaps[2 * i + 1] & _HEAP_DEVICE_LOCAL))
                  for i in range(mem.memoryHeapCount))
    return DeviceInfo(index, base.deviceName.decode(errors="replace"),
                      _DEVICE_TYPES.get(base.deviceType, "other"), base.vendorID, base.deviceID,
                      _version(base.apiVersion), base.driverVersion,
                      driver.driverName.decode(errors="replace") if have_driver else "",
                      driver.driverInfo.decode(errors="replace") if have_driver else "",
                      limits, heaps)
