"""``SHADERS``: every variant's declaration (kvdict_vk/vk/abi.py) joined with the arithmetic
of its dispatches — which words of each binding a dispatch touches (extents) and how many
invocations share a row (groups) — registered by the modules that own that arithmetic:
kvdict_vk/vk/extents.py (the arena's shaders, here), and each wing's specs module when it is
imported (attend/specs.py, encode/specs.py, forward/specs.py), so the floor imports no wing.
kernels.Kernel looks variants up here (``spec``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import errors as E
from . import abi
from . import extents as core_extents


def one_group(spec) -> int:
    return 1


@dataclass(frozen=True)
class ShaderSpec:
    """A variant's declaration with the arithmetic of its dispatches."""
    decl: abi.Variant
    extents: Callable  # (push dict, spec dict) -> per binding, a list of spans (first, one past last)
    groups: Callable = one_group  # invocations that share one row (grid stride % groups == 0)

    @property
    def variant(self) -> str:  # the SPIR-V name (shader_build.VARIANTS)
        return self.decl.name

    @property
    def push(self) -> abi.PushBlock:
        return self.decl.push

    @property
    def lanes(self) -> tuple:  # per binding: words per element (4 for vec4/uvec4 views)
        return self.decl.lanes

    @property
    def writes(self) -> tuple:  # per binding: whether the shader writes it
        return self.decl.writes

    @property
    def spec_names(self) -> tuple:  # specialization constants by constant_id
        return self.decl.spec

    @property
    def optional_spec(self) -> tuple:  # ((name, default), …): may be omitted, and may be 0
        return self.decl.optional_spec

    @property
    def subgroup_ops(self) -> tuple:  # subgroup operation classes it uses
        return self.decl.subgroup_ops

    @property
    def features(self) -> tuple:  # other optional device features it needs (abi.FEATURES)
        return self.decl.features


SHADERS: dict = {}  # variant name -> ShaderSpec, filled by register()


def register(extents: dict, groups: dict | None = None) -> None:
    """Add variants' dispatch arithmetic: ``extents`` (and ``groups``) by variant name, each a
    declared variant (a wing registers its own when its specs module is imported)."""
    groups = groups or {}
    unknown = (set(extents) | set(groups)) - set(abi.DECLARATIONS)
    if unknown or not set(groups) <= set(extents):
        raise ValueError(f"extents or groups for undeclared variants {sorted(unknown)}, "
                         f"groups without extents {sorted(set(groups) - set(extents))}")
    SHADERS.update({name: ShaderSpec(abi.DECLARATIONS[name], f, groups.get(name, one_group))
                    for name, f in extents.items()})


def spec(name: str) -> ShaderSpec:
    """The variant's ShaderSpec; a declared variant whose wing has not been imported yet, or
    an unknown name, is a DispatchError."""
    if name in SHADERS:
        return SHADERS[name]
    if name in abi.DECLARATIONS:
        raise E.DispatchError(f"{name}: no dispatch arithmetic registered (import its wing's specs module)")
    raise E.DispatchError(f"unknown shader variant {name!r}")


register(core_extents.EXTENTS, core_extents.GROUPS)
