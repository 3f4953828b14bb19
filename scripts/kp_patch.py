"""Patch kp 0.9.0 (run by setup.sh, and by the GPU bundle's env.sh, on the unpacked sdist).

1. **A compute→compute barrier for Python.** Kompute's C++ has kp::OpMemoryBarrier, but
   0.9.0 does not expose it to Python, and its dispatches only record a transfer→compute
   barrier before them. Without a compute→compute barrier, two dispatches of one
   submission that write and then read the same buffer may overlap on a real GPU
   (lavapipe happens to run them in order; the synchronization validation layer reports
   them). This binds ``kp.OpComputeBarrier(tensors)``: a buffer memory barrier on each
   tensor's primary buffer, compute-shader writes → compute-shader reads and writes.

2. **Sequences that are cheap to evaluate again** (src/Sequence.cpp; measured on an
   NVIDIA H200, one eval of a recorded 4-byte sync: 584 µs as shipped, 42 µs with the
   fence reused, ~15 µs with the fence reused and polled):
   * one VkFence per sequence, made on the first submit, reset before each later one and
     destroyed with the sequence (0.9.0 creates and destroys a fence in every eval);
   * the wait polls vkGetFenceStatus for up to a bound (default 20 000 µs on GPUs — a
     recorded decode step of a model at long context runs for milliseconds, and waking from
     vkWaitForFences added 100–400 µs to such a step's host time —, 0 on CPU drivers, whose
     worker threads need the cores; ``KVDICT_VK_FENCE_POLL_US`` overrides), then blocks in
     vkWaitForFences, so long waits do not burn a core;
   * the command pool is made with RESET_COMMAND_BUFFER, so a sequence may be cleared and
     recorded again (vkBeginCommandBuffer resets it implicitly — legal only with that flag);
   * the timestamp query pool is reset at the start of every recording (0.9.0 never
     resets it, so a second evaluation writes timestamps into queries that were never
     reset: undefined), and a timestamp past the pool's size is not written.

3. **Timestamps only where they are read** (src/Sequence.cpp, the bindings): 0.9.0 latches
   a timestamp after every recorded op, with ALL_COMMANDS — each waits for the work before
   it, so one inside a timed span lengthens it (lab/NOTEBOOK.md, "Timestamps").
   ``Sequence.record_unlatched(op)`` records an op with none after it; the timestamps
   written are numbered in order, and ``get_timestamps`` returns those (the first, before any op, and one per latched op).

4. **Optional device features, enabled where the device reports them** (src/Manager.cpp):
   16-bit storage, float16/int8 arithmetic, 8-bit storage, integer dot products and float
   atomics — the feature structs kvdict_vk/vk/vulkan_info.py reads, chained into
   VkDeviceCreateInfo as vkGetPhysicalDeviceFeatures2 fills them (with their extensions;
   Kompute's instance is Vulkan 1.1), so a kernel variant that declares one
   (kvdict_vk/vk/abi.py's FEATURES) runs wherever the device has it. No Vulkan 1.0 core
   feature is enabled (robustBufferAccess would cost every load a bounds check). Cooperative
   matrices come through VK_NV_cooperative_matrix (attend_mma; with the Vulkan memory model,
   which glslang builds them under): Debian 12's glslang cannot build
   GL_KHR_cooperative_matrix, and its validation layer (1.3.239) predates the KHR feature struct.

5. **No barrier before every dispatch** (src/OpAlgoDispatch.cpp, OpTensorSync*.cpp,
   OpTensorCopy.cpp): 0.9.0 records a transfer→compute buffer barrier on each of a dispatch's
   tensors before it — three to six pipeline barriers a dispatch, which order nothing our
   kernels need (compute→compute is OpComputeBarrier's, recorded where a kernel reads what
   one before it wrote) and, on an H100, each made a dispatch wait for the one before. The
   transfers record the barriers instead: a copy into a buffer waits for earlier dispatches'
   use of it and is made visible to later dispatches; a copy out of one (or between two)
   is finished before a later dispatch writes it.

6. **The GIL released while a sequence runs** (python/src/main.cpp: ``Sequence.eval()`` and
   ``eval_await()``): 0.9.0's bindings hold it through the submit and the fence wait, so a
   Python thread driving one device stops every other thread — two devices driven from two
   threads (kvdict_vk.vk.split) ran one after the other. Nothing in an eval calls back into
   Python; the callers serialise their own use of a device (kvdict_vk.vk.device's guard).

    python scripts/kp_patch.py <kp-0.9.0 source dir>
"""
import sys
from pathlib import Path

MARK = "kvdict_vk patch"

BARRIER_ANCHOR = "    py::class_<kp::OpAlgoDispatch,"
BARRIER = """    // kvdict_vk patch: a compute->compute barrier (scripts/kp_patch.py says why)
    py::class_<kp::OpMemoryBarrier, kp::OpBase, std::shared_ptr<kp::OpMemoryBarrier>>(
      m, "OpComputeBarrier")
      .def(py::init([](const std::vector<std::shared_ptr<kp::Tensor>>& tensors) {
          return std::make_shared<kp::OpMemoryBarrier>(
            tensors,
            vk::AccessFlagBits::eShaderWrite,
            static_cast<vk::AccessFlagBits>(VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT),
            vk::PipelineStageFlagBits::eComputeShader,
            vk::PipelineStageFlagBits::eComputeShader,
            true);
      }));

"""

DEVICE_ANCHOR = """    vk::DeviceCreateInfo deviceCreateInfo(vk::DeviceCreateFlags(),
                                          deviceQueueCreateInfos.size(),
                                          deviceQueueCreateInfos.data(),
                                          {},
                                          {},
                                          validExtensions.size(),
                                          validExtensions.data());
"""
DEVICE_FEATURES = """    // kvdict_vk patch: the optional features kernel variants may need, enabled where the
    // device reports them (scripts/kp_patch.py; kvdict_vk/vk/vulkan_info.py reads the same)
    struct KvFeatureBools {
        VkStructureType sType;
        void* pNext;
        VkBool32 bools[12];  // the longest of the structs below (atomic float: 12)
    };
    const std::pair<const char*, int> kvFeatureStructs[] = {
        { nullptr, 1000083000 },                              // 16-bit storage (Vulkan 1.1)
        { "VK_KHR_shader_float16_int8", 1000082000 },
        { "VK_KHR_8bit_storage", 1000177000 },
        { "VK_KHR_shader_integer_dot_product", 1000280000 },
        { "VK_EXT_shader_atomic_float", 1000260000 },
        { "VK_NV_cooperative_matrix", 1000249000 },
        { "VK_KHR_vulkan_memory_model", 1000211000 },  // glslang builds NV cooperative matrices under it
    };
    const int kvStructCount = sizeof(kvFeatureStructs) / sizeof(kvFeatureStructs[0]);
    KvFeatureBools kvStructs[kvStructCount] = {};
    VkPhysicalDeviceFeatures2 kvFeatures2 = {};
    kvFeatures2.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2;
    void** kvTail = &kvFeatures2.pNext;
    for (int i = 0; i < kvStructCount; ++i) {
        const char* ext = kvFeatureStructs[i].first;
        if (ext != nullptr) {
            if (uniqueExtensionNames.count(ext) == 0)
                continue;
            bool listed = false;
            for (const char* have : validExtensions)
                listed = listed || std::string(have) == ext;
            if (!listed)
                validExtensions.push_back(ext);
        }
        kvStructs[i].sType = static_cast<VkStructureType>(kvFeatureStructs[i].second);
        *kvTail = &kvStructs[i];
        kvTail = &kvStructs[i].pNext;
    }
    vkGetPhysicalDeviceFeatures2(static_cast<VkPhysicalDevice>(physicalDevice), &kvFeatures2);
    kvFeatures2.features = VkPhysicalDeviceFeatures{};  // no Vulkan 1.0 feature

"""

# (file, anchor that must occur exactly once, replacement)
_RW = "static_cast<vk::AccessFlagBits>(VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT)"
_NONE = "static_cast<vk::AccessFlagBits>(0)"


def _primary_barrier(tensor: str, src: str, dst: str, src_stage: str, dst_stage: str, indent: int = 12) -> str:
    pad = " " * indent
    return (f"{pad}{tensor}->recordPrimaryBufferMemoryBarrier(\n"
            f"{pad}  commandBuffer, {src}, {dst},\n"
            f"{pad}  vk::PipelineStageFlagBits::{src_stage}, vk::PipelineStageFlagBits::{dst_stage});\n")


_TO_TRANSFER = ("eComputeShader", "eTransfer")
_TO_COMPUTE = ("eTransfer", "eComputeShader")
# item 5: the barrier before every dispatch out, the transfers' barriers in
DISPATCH_EDITS = [
    ("src/OpAlgoDispatch.cpp",
     "    // Barrier to ensure the data is finished writing to buffer memory\n"
     "    for (const std::shared_ptr<Tensor>& tensor :\n"
     "         this->mAlgorithm->getTensors()) {\n"
     "        tensor->recordPrimaryBufferMemoryBarrier(\n"
     "          commandBuffer,\n"
     "          vk::AccessFlagBits::eTransferWrite,\n"
     "          vk::AccessFlagBits::eShaderRead,\n"
     "          vk::PipelineStageFlagBits::eTransfer,\n"
     "          vk::PipelineStageFlagBits::eComputeShader);\n"
     "    }\n",
     "    // kvdict_vk patch: no barrier before a dispatch; the transfers record theirs\n"),
    ("src/OpTensorSyncDevice.cpp",
     "            this->mTensors[i]->recordCopyFromStagingToDevice(commandBuffer);\n",
     "            // kvdict_vk patch: after earlier dispatches' use, before later ones'\n"
     + _primary_barrier("this->mTensors[i]", _RW, "vk::AccessFlagBits::eTransferWrite", *_TO_TRANSFER)
     + "            this->mTensors[i]->recordCopyFromStagingToDevice(commandBuffer);\n"
     + _primary_barrier("this->mTensors[i]", "vk::AccessFlagBits::eTransferWrite", _RW, *_TO_COMPUTE)),
    ("src/OpTensorSyncLocal.cpp",
     "            this->mTensors[i]->recordCopyFromDeviceToStaging(commandBuffer);\n",
     "            this->mTensors[i]->recordCopyFromDeviceToStaging(commandBuffer);\n"
     "            // kvdict_vk patch: read before a later dispatch writes it\n"
     + _primary_barrier("this->mTensors[i]", _NONE, "vk::AccessFlagBits::eShaderWrite", *_TO_COMPUTE)),
    ("src/OpTensorCopy.cpp",
     "        this->mTensors[i]->recordCopyFrom(commandBuffer, this->mTensors[0]);\n    }\n",
     "        this->mTensors[i]->recordCopyFrom(commandBuffer, this->mTensors[0]);\n"
     "        // kvdict_vk patch: written before later dispatches use it\n"
     + _primary_barrier("this->mTensors[i]", "vk::AccessFlagBits::eTransferWrite", _RW, *_TO_COMPUTE, indent=8)
     + "    }\n"
     "    // kvdict_vk patch: read before a later dispatch writes it\n"
     + _primary_barrier("this->mTensors[0]", _NONE, "vk::AccessFlagBits::eShaderWrite", *_TO_COMPUTE, indent=4)),
]

SEQUENCE_EDITS = [
    ("src/include/kompute/Sequence.hpp",
     "    vk::Fence mFence;\n",
     "    vk::Fence mFence;  // kvdict_vk patch: made once, reset before each submit\n"
     "    uint32_t mTimestampCount = 0;\n"
     "    uint32_t mLatched = 0;  // timestamps written after ops since begin()\n"
     "    bool mLatchNext = true;\n"
     "    uint64_t mPollMicros = 0;\n"),
    ("src/include/kompute/Sequence.hpp",
     "    std::shared_ptr<Sequence> record(std::shared_ptr<OpBase> op);\n",
     "    std::shared_ptr<Sequence> record(std::shared_ptr<OpBase> op);\n"
     "    // kvdict_vk patch: record an op with no timestamp after it\n"
     "    std::shared_ptr<Sequence> recordUnlatched(std::shared_ptr<OpBase> op);\n"),
    ("src/Sequence.cpp",
     '#include "kompute/Sequence.hpp"\n',
     '#include "kompute/Sequence.hpp"\n\n#include <chrono>\n#include <cstdlib>\n'),
    ("src/Sequence.cpp",
     "    this->createCommandPool();\n    this->createCommandBuffer();\n",
     "    this->createCommandPool();\n    this->createCommandBuffer();\n"
     "    // kvdict_vk patch: poll the fence for short waits on GPUs (not on CPU drivers)\n"
     "    this->mPollMicros = physicalDevice->getProperties().deviceType ==\n"
     "                            vk::PhysicalDeviceType::eCpu ? 0 : 20000;\n"
     '    if (const char* env = std::getenv("KVDICT_VK_FENCE_POLL_US"))\n'
     "        this->mPollMicros = std::strtoull(env, nullptr, 10);\n"),
    ("src/Sequence.cpp",
     "    this->mRecording = true;\n\n    // latch the first timestamp before any commands are submitted\n"
     "    if (this->timestampQueryPool)\n",
     "    this->mRecording = true;\n\n    // latch the first timestamp before any commands are submitted\n"
     "    // (kvdict_vk patch: after resetting the queries, which 0.9.0 never does)\n"
     "    this->mLatched = 0;\n"
     "    if (this->timestampQueryPool)\n"
     "        this->mCommandBuffer->resetQueryPool(\n"
     "          *this->timestampQueryPool, 0, this->mTimestampCount);\n"
     "    if (this->timestampQueryPool)\n"),
    ("src/Sequence.cpp",
     "    this->mFence = this->mDevice->createFence(vk::FenceCreateInfo());\n",
     "    // kvdict_vk patch: one fence per sequence, reset before each later submit\n"
     "    if (!this->mFence)\n"
     "        this->mFence = this->mDevice->createFence(vk::FenceCreateInfo());\n"
     "    else\n"
     "        (void)this->mDevice->resetFences(1, &this->mFence);\n"),
    ("src/Sequence.cpp",
     "    vk::Result result =\n      this->mDevice->waitForFences(1, &this->mFence, VK_TRUE, waitFor);\n"
     "    this->mDevice->destroy(\n      this->mFence, (vk::Optional<const vk::AllocationCallbacks>)nullptr);\n",
     "    // kvdict_vk patch: poll up to mPollMicros, then block; the fence is kept\n"
     "    vk::Result result = this->mDevice->getFenceStatus(this->mFence);\n"
     "    if (result == vk::Result::eNotReady && this->mPollMicros > 0) {\n"
     "        auto until = std::chrono::steady_clock::now() +\n"
     "                     std::chrono::microseconds(this->mPollMicros);\n"
     "        do {\n"
     "            result = this->mDevice->getFenceStatus(this->mFence);\n"
     "        } while (result == vk::Result::eNotReady &&\n"
     "                 std::chrono::steady_clock::now() < until);\n"
     "    }\n"
     "    if (result == vk::Result::eNotReady)\n"
     "        result = this->mDevice->waitForFences(1, &this->mFence, VK_TRUE, waitFor);\n"),
    ("src/Sequence.cpp",
     "    if (this->mFreeCommandBuffer) {\n        KP_LOG_INFO(\"Freeing CommandBuffer\");\n",
     "    if (this->mFence) {  // kvdict_vk patch: the fence lives as long as the sequence\n"
     "        this->mDevice->destroy(\n"
     "          this->mFence, (vk::Optional<const vk::AllocationCallbacks>)nullptr);\n"
     "        this->mFence = nullptr;\n"
     "    }\n\n"
     "    if (this->mFreeCommandBuffer) {\n        KP_LOG_INFO(\"Freeing CommandBuffer\");\n"),
    ("src/Sequence.cpp",
     "    if (this->timestampQueryPool)\n        this->mCommandBuffer->writeTimestamp(\n"
     "          vk::PipelineStageFlagBits::eAllCommands,\n          *this->timestampQueryPool,\n"
     "          this->mOperations.size());\n",
     "    // kvdict_vk patch: timestamps numbered as written, none past the pool's size\n"
     "    if (this->timestampQueryPool && this->mLatchNext &&\n"
     "        this->mLatched + 1 < this->mTimestampCount)\n"
     "        this->mCommandBuffer->writeTimestamp(\n"
     "          vk::PipelineStageFlagBits::eAllCommands,\n          *this->timestampQueryPool,\n"
     "          ++this->mLatched);\n"
     "    this->mLatchNext = true;\n"),
    ("src/Sequence.cpp",
     "std::vector<std::uint64_t>\nSequence::getTimestamps()\n",
     "// kvdict_vk patch\n"
     "std::shared_ptr<Sequence>\nSequence::recordUnlatched(std::shared_ptr<OpBase> op)\n{\n"
     "    this->mLatchNext = false;\n"
     "    return this->record(op);\n}\n\n"
     "std::vector<std::uint64_t>\nSequence::getTimestamps()\n"),
    ("src/Sequence.cpp",
     "    const auto n = this->mOperations.size() + 1;\n",
     "    const auto n = this->mLatched + 1;  // kvdict_vk patch: those written\n"),
    ("python/src/main.cpp",
     "      .def(\"rerecord\", &kp::Sequence::rerecord, DOC(kp, Sequence, rerecord))\n",
     "      .def(\"rerecord\", &kp::Sequence::rerecord, DOC(kp, Sequence, rerecord))\n"
     "      .def(  // kvdict_vk patch\n"
     "        \"record_unlatched\",\n"
     "        [](kp::Sequence& self, std::shared_ptr<kp::OpBase> op) {\n"
     "            return self.recordUnlatched(op);\n"
     "        })\n"),
    ("src/Sequence.cpp",
     "    vk::CommandPoolCreateInfo commandPoolInfo(vk::CommandPoolCreateFlags(),\n",
     "    // kvdict_vk patch: command buffers may be recorded again\n"
     "    vk::CommandPoolCreateInfo commandPoolInfo(\n"
     "      vk::CommandPoolCreateFlagBits::eResetCommandBuffer,\n"),
    ("src/Sequence.cpp",
     "        queryPoolInfo.setQueryCount(totalTimestamps);\n",
     "        queryPoolInfo.setQueryCount(totalTimestamps);\n"
     "        this->mTimestampCount = totalTimestamps;  // kvdict_vk patch\n"),
]


def _edit(path: Path, anchor: str, replacement: str) -> None:
    text = path.read_text()
    if text.count(anchor) != 1:
        raise SystemExit(f"kp_patch: {path} does not look like kp 0.9.0 (anchor found "
                         f"{text.count(anchor)} times):\n{anchor}")
    path.write_text(text.replace(anchor, replacement))


# item 6: the GIL released around a sequence's submit and wait
GIL_EDITS = [
    ("python/src/main.cpp",
     '        "eval",\n'
     "        [](kp::Sequence& self) { return self.eval(); },\n",
     '        "eval",\n'
     "        [](kp::Sequence& self) {\n"
     "            py::gil_scoped_release nogil;  // kvdict_vk patch: other threads run meanwhile\n"
     "            return self.eval();\n"
     "        },\n"),
    ("python/src/main.cpp",
     '        "eval_await",\n'
     "        [](kp::Sequence& self) { return self.evalAwait(); },\n",
     '        "eval_await",\n'
     "        [](kp::Sequence& self) {\n"
     "            py::gil_scoped_release nogil;  // kvdict_vk patch: other threads run meanwhile\n"
     "            return self.evalAwait();\n"
     "        },\n"),
]


def main(src: str) -> int:
    root = Path(src)
    bindings = root / "python" / "src" / "main.cpp"
    if MARK in bindings.read_text():
        return 0  # already patched
    _edit(bindings, BARRIER_ANCHOR, BARRIER + BARRIER_ANCHOR)
    _edit(root / "src" / "Manager.cpp", DEVICE_ANCHOR,
          DEVICE_FEATURES + DEVICE_ANCHOR + "    deviceCreateInfo.setPNext(&kvFeatures2);  // kvdict_vk patch\n")
    for rel, anchor, replacement in SEQUENCE_EDITS + DISPATCH_EDITS + GIL_EDITS:
        _edit(root / rel, anchor, replacement)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
