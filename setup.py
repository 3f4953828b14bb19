"""Build hook only — the project's configuration lives in pyproject.toml.

``build_py`` first compiles ``shaders/*.comp`` to ``kvdict_vk/spv/*.spv`` (glslangValidator +
spirv-val, see kvdict_vk/vk/shader_build.py), so the wheel ships SPIR-V as package data
and needs no shader compiler at install or run time.
"""
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _shader_build():
    # Loaded by path: importing the package would need its runtime dependencies (kp, …).
    spec = importlib.util.spec_from_file_location("_kvdict_shader_build",
                                                  ROOT / "kvdict_vk" / "vk" / "shader_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithShaders(build_py):
    def run(self):
        sb = _shader_build()
        if sb.in_checkout():  # a checkout or an sdist
            built = sb.build()
            if built:
                self.announce(f"compiled SPIR-V: {', '.join(built)}", level=2)
        super().run()


setup(cmdclass={"build_py": BuildPyWithShaders})
