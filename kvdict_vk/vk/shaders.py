"""``SHADERS``: every variant's declaration (kvdict_vk/vk/abi.py) joined with the arithmetic
of its dispatches — which words of each binding a dispatch touches (extents) and how many
invocations share a row (groups) — from the modules that own that arithmetic:
kvdict_vk/vk/extents.py (the arena's shaders), attend/specs.py, encode/specs.py.

Imports: abi, extents and the two spec modules, none of which imports this module or
kernels; kernels.Kernel looks variants up here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import abi
from . import extents as core_extents
from .attend import specs as attend_specs
from .encode import specs as encode_specs


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


def _assemble() -> dict:
    extents, groups = {}, {}
    for more, more_groups in ((core_extents.EXTENTS, core_extents.GROUPS), (attend_specs.EXTENTS, {}),
                              (encode_specs.EXTENTS, encode_specs.GROUPS)):
        if set(extents) & set(more):
            raise ValueError(f"extents declared twice for {sorted(set(extents) & set(more))}")
        extents.update(more)
        groups.update(more_groups)
    if set(extents) != set(abi.DECLARATIONS) or not set(groups) <= set(abi.DECLARATIONS):
        raise ValueError(f"extents without a declaration {sorted(set(extents) - set(abi.DECLARATIONS))}, "
                         f"declarations without extents {sorted(set(abi.DECLARATIONS) - set(extents))}, "
                         f"undeclared groups {sorted(set(groups) - set(abi.DECLARATIONS))}")
    return {name: ShaderSpec(decl, extents[name], groups.get(name, one_group))
            for name, decl in abi.DECLARATIONS.items()}


SHADERS: dict = _assemble()
