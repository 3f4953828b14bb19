"""Probe: what the driver's compiler made of each kernel the engine builds — register count,
spills, shared memory, instruction count — through VK_KHR_pipeline_executable_properties.

Kompute 0.9.0 creates its pipelines without VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR and
exposes no handle to ask, so this probe (1) runs the engine's own workloads on the device —
f16-cache attention per shape and context (the tuner building every candidate launch shape
and both attend_flash builds), attention over the codes and reconstruct over binary16 and
float32 atoms — while recording every kernel it creates (variant, specialization constants,
bindings, push-block size), then (2) rebuilds each distinct one on the same physical device
through the `vulkan` package (cffi bindings of the Vulkan API; a tool-only dependency:
`pip install vulkan`; on the H200, its wheel and cp312 wheels of cffi and pycparser in
.bundle/whl/, which env.sh installs) with statistics captured, and reads the driver's
statistics for it.
Drivers without the extension (llvmpipe) still get (2)'s pipelines built — the plumbing's
check — and report ``"statistics": null``. One JSON object to stdout, lines to stderr.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/pipeline_stats.py \\
        --shapes 3x3x64,8x4x64 --n-used 32768,131072 > $OUT/pipeline_stats.json

Run as ``python lab/probes/pipeline_stats.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

from kvdict_vk.bench import attention as BA, common, reconstruct
from kvdict_vk.vk import KvArena, kernels, spirv

EXTENSION = "VK_KHR_pipeline_executable_properties"


def record_kernels(run, variant_prefix: str = "") -> list[dict]:
    """Every distinct kernel the engine creates while ``run()`` runs (of variants named
    ``variant_prefix``…): variant, its specialization (by name and as the driver gets it),
    bindings, push-block bytes, the SPIR-V directory it was loaded from ($KVDICT_VK_SPV_DIR,
    "" for the package's)."""
    seen: dict[tuple, dict] = {}
    plain = kernels.Kernel.__init__

    def init(self, *a, **k):
        plain(self, *a, **k)
        sh = self.shader
        if not sh.variant.startswith(variant_prefix):
            return
        values = tuple(int(self.spec[n]) for n in sh.spec_names)
        spv_dir = os.environ.get(spirv.SPV_DIR_ENV, "")
        seen.setdefault((spv_dir, sh.variant, values),
                        {"variant": sh.variant, "spec": {n: int(self.spec[n]) for n in sh.spec_names},
                         "spec_values": values, "bindings": len(sh.lanes), "push_bytes": sh.push.size_bytes,
                         "spv_dir": spv_dir})
    kernels.Kernel.__init__ = init
    try:
        run()
    finally:
        kernels.Kernel.__init__ = plain
    return list(seen.values())


def engine_workloads(dev, a) -> None:
    """The workloads whose kernels are inspected (each attention runs once: the tuner's
    candidates are built and timed on its first call)."""
    rng = np.random.default_rng(0)
    ns = [int(x) for x in a.n_used.split(",")]
    for cache in a.caches.split(","):
        for shape in a.shapes.split(","):
            n_kv, gqa, hd = common.dims(shape)
            arena = KvArena(1, n_kv, hd, max(ns), device=dev, cache=cache)
            rows = BA.random_rows(rng, n_kv, max(ns), hd)
            arena.append(0, rows, rows)
            q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
            if a.flash_kernel:  # one build only (e.g. attend_mma: "mma")
                att = arena.attention(n_kv * gqa)
                att.path, att.flash_kernel = "flash", a.flash_kernel
            for n in ns:
                arena.attend(0, q, n)
                print(f"[stats] {cache} attention {shape} n_used {n}", file=sys.stderr, flush=True)
            arena.free()
    if a.no_codes:
        return
    # the codes: the certified shape's format (s 4, 4-bit residual, per-head, 1024 atoms)
    args = reconstruct.parse_args(["--n-kv", "8", "--head-dim", "64", "--n-ctx", str(a.coded_tokens),
                                   "--sparsity", "4", "--residual-bits", "4", "--per-head", "--sweep="])
    for f16_atoms in (True, False):
        arena, _, _ = reconstruct.coded_arena(4, args, dev, rng, f16_atoms)
        arena.read(0, 0, a.coded_tokens)
        if f16_atoms:  # 4 query heads per KV head (the 8 x 4 shape)
            q = rng.standard_normal((4 * args.n_kv, args.head_dim), dtype=np.float32)
            arena.attend(0, q, a.coded_tokens)
        arena.free()
        print(f"[stats] codes ({'binary16' if f16_atoms else 'float32'} atoms)", file=sys.stderr, flush=True)


def _text(vk, x) -> str:
    """A fixed-size char array of a returned struct: the package already hands some back as str."""
    return x if isinstance(x, str) else vk.ffi.string(x).decode()


def _stat_value(vk, s):
    fmt = s.format
    if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR:
        return bool(s.value.b32)
    if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR:
        return int(s.value.i64)
    if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR:
        return int(s.value.u64)
    return float(s.value.f64)


class StatsDevice:
    """A bare Vulkan device on the physical device named like ``name``, with pipeline
    statistics enabled where the driver has them."""

    def __init__(self, name: str):
        import vulkan as vk
        self.vk = vk
        app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName="kvdict pipeline_stats",
                                   applicationVersion=1, pEngineName="kvdict_vk", engineVersion=1,
                                   apiVersion=vk.VK_MAKE_VERSION(1, 1, 0))
        self.instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                                                    pApplicationInfo=app), None)
        pds = [(pd, vk.vkGetPhysicalDeviceProperties(pd).deviceName) for pd in vk.vkEnumeratePhysicalDevices(self.instance)]
        match = [(pd, n) for pd, n in pds if name.lower() in n.lower()]
        if not match:
            raise SystemExit(f"no Vulkan device named like {name!r} among {[n for _, n in pds]}")
        pd, self.name = match[0]
        exts = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(pd, None)}
        self.supported = EXTENSION in exts
        family = next(i for i, f in enumerate(vk.vkGetPhysicalDeviceQueueFamilyProperties(pd))
                      if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT)
        queue = vk.VkDeviceQueueCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, queueFamilyIndex=family,
                                           queueCount=1, pQueuePriorities=[1.0])
        feature, enabled = None, [EXTENSION] if self.supported else []
        # attend_mma's features, as kp enables them (scripts/kp_patch.py): binary16 arithmetic,
        # NV cooperative matrices and the Vulkan memory model glslang builds them under
        mma = ("VK_KHR_shader_float16_int8", "VK_NV_cooperative_matrix", "VK_KHR_vulkan_memory_model")
        if set(mma) <= exts:
            enabled += list(mma)
            feature = vk.VkPhysicalDeviceShaderFloat16Int8Features(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES, shaderFloat16=vk.VK_TRUE,
                pNext=vk.VkPhysicalDeviceCooperativeMatrixFeaturesNV(
                    sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_NV, cooperativeMatrix=vk.VK_TRUE,
                    pNext=vk.VkPhysicalDeviceVulkanMemoryModelFeatures(
                        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES,
                        vulkanMemoryModel=vk.VK_TRUE)))
        if self.supported:
            feature = vk.VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR,
                pipelineExecutableInfo=vk.VK_TRUE, pNext=feature)
        info = vk.VkDeviceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=feature, queueCreateInfoCount=1,
                                     pQueueCreateInfos=[queue], enabledExtensionCount=len(enabled),
                                     ppEnabledExtensionNames=enabled)
        self.device = vk.vkCreateDevice(pd, info, None)
        if self.supported:
            self._props = vk.vkGetDeviceProcAddr(self.device, "vkGetPipelineExecutablePropertiesKHR")
            self._stats = vk.vkGetDeviceProcAddr(self.device, "vkGetPipelineExecutableStatisticsKHR")

    def statistics(self, k: dict) -> list[dict] | None:
        """Build kernel ``k`` (record_kernels' entry) and return each executable's statistics."""
        vk = self.vk
        code = spirv.load(k["variant"])
        module = vk.vkCreateShaderModule(self.device, vk.VkShaderModuleCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code), pCode=code), None)
        binds = [vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                 descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                 for i in range(k["bindings"])]
        dsl = vk.vkCreateDescriptorSetLayout(self.device, vk.VkDescriptorSetLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=len(binds), pBindings=binds), None)
        ranges = [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=k["push_bytes"])]
        layout = vk.vkCreatePipelineLayout(self.device, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=[dsl],
            pushConstantRangeCount=int(k["push_bytes"] > 0), pPushConstantRanges=ranges if k["push_bytes"] else None), None)
        values = np.asarray(k["spec_values"], np.uint32).tobytes()
        entries = [vk.VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4) for i in range(len(k["spec_values"]))]
        spec = vk.VkSpecializationInfo(mapEntryCount=len(entries), pMapEntries=entries, dataSize=len(values),
                                       pData=vk.ffi.from_buffer(values)) if entries else None
        stage = vk.VkPipelineShaderStageCreateInfo(sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                                                   stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName="main",
                                                   pSpecializationInfo=spec)
        flags = vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR if self.supported else 0
        info = vk.VkComputePipelineCreateInfo(sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, flags=flags,
                                              stage=stage, layout=layout, basePipelineIndex=-1)
        pipeline = vk.vkCreateComputePipelines(self.device, None, 1, [info], None)[0]
        try:
            if not self.supported:
                return None
            out = []
            execs = self._props(self.device, vk.VkPipelineInfoKHR(sType=vk.VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR,
                                                                 pipeline=pipeline))
            for i, e in enumerate(execs):
                stats = self._stats(self.device, vk.VkPipelineExecutableInfoKHR(
                    sType=vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR, pipeline=pipeline, executableIndex=i))
                out.append({"executable": _text(vk, e.name), "subgroup_size": int(e.subgroupSize),
                            "statistics": {_text(vk, s.name): _stat_value(vk, s) for s in stats}})
            return out
        finally:
            vk.vkDestroyPipeline(self.device, pipeline, None)
            vk.vkDestroyPipelineLayout(self.device, layout, None)
            vk.vkDestroyDescriptorSetLayout(self.device, dsl, None)
            vk.vkDestroyShaderModule(self.device, module, None)

    def close(self) -> None:
        self.vk.vkDestroyDevice(self.device, None)
        self.vk.vkDestroyInstance(self.instance, None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3x3x64,8x4x64,3x3x128,8x4x128", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="32768,131072")
    ap.add_argument("--coded-tokens", type=int, default=32768, help="tokens per KV head of the coded arenas")
    ap.add_argument("--caches", default="f16", help="row caches attended over (f16, f32, q8_0, kivi), comma-separated")
    ap.add_argument("--no-codes", action="store_true", help="skip the coded arenas")
    ap.add_argument("--flash-kernel", default="", help="the rows' flash build to inspect only (attend.FLASH_KERNELS, "
                                                        "attend.MMA_KERNEL); default: the tuner's candidates")
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    a = ap.parse_args(argv)
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    found = record_kernels(lambda: engine_workloads(dev, a))
    stats_dev = StatsDevice(dev.name)
    try:
        for k in found:
            k["executables"] = stats_dev.statistics(k)
            k["spec_values"] = list(k["spec_values"])
            brief = {s: v for e in (k["executables"] or []) for s, v in e["statistics"].items() if "egister" in s}
            print(f"[stats] {k['variant']} {k['spec']} {brief}", file=sys.stderr, flush=True)
    finally:
        stats_dev.close()
    json.dump({"argv": sys.argv, "device": dev.name, "statistics_supported": stats_dev.supported,
               "kernels": found}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
