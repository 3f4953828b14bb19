"""Vulkan backend (Kompute): device choice, SPIR-V loading, the KV arena, dispatch.

The only package of kvdict_vk that imports ``kp``. Attributes are resolved lazily, so
``kvdict_vk.vk.shader_build`` (run at wheel-build time, where kp may be absent) and
``kvdict_vk.vk.vulkan_info`` can be imported without Kompute.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "KvArena": "arena.arena", "ReadPlan": "read.reader", "Attention": "attend.engine",
    "SplitArena": "split", "open_devices": "split",
    "list_devices": "device", "get_device": "device", "Device": "device", "DeviceInfo": "vulkan_info",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
