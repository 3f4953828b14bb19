"""Patch kp 0.9.0's Python bindings (run by setup.sh on the unpacked sdist).

Kompute's C++ has kp::OpMemoryBarrier, but 0.9.0 does not expose it to Python, and its
dispatches only record a transfer→compute barrier before them. Without a compute→compute
barrier, two dispatches of one submission that write and then read the same buffer may
overlap on a real GPU (lavapipe happens to run them in order; the synchronization
validation layer reports them). This binds ``kp.OpComputeBarrier(tensors)``: a buffer
memory barrier on each tensor's primary buffer, compute-shader writes → compute-shader
reads and writes.

    python scripts/kp_patch.py <kp-0.9.0 source dir>
"""
import sys
from pathlib import Path

ANCHOR = "    py::class_<kp::OpAlgoDispatch,"
BINDING = """    // kvdict_vk: a compute->compute barrier (scripts/kp_patch.py says why)
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


def main(src: str) -> int:
    path = Path(src) / "python" / "src" / "main.cpp"
    text = path.read_text()
    if "OpComputeBarrier" in text:
        return 0
    if text.count(ANCHOR) != 1:
        print(f"kp_patch: {path} does not look like kp 0.9.0's bindings", file=sys.stderr)
        return 1
    path.write_text(text.replace(ANCHOR, BINDING + ANCHOR))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
