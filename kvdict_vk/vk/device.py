"""Device choice and the process-wide Kompute manager.

Default device: the first one. ``KVDICT_VK_DEVICE`` picks another, by index ("1") or by a
case-insensitive substring of its name ("llvmpipe", "radeon"); ``get_device(spec)`` takes
the same forms. One ``kp.Manager`` per chosen device per process, created lazily. Every
Kompute/Vulkan failure surfaces as a :class:`~kvdict_vk.errors.VulkanError` naming the
device (see :meth:`Device.guard`).
"""
from __future__ import annotations

import contextlib
import os
import threading

import kp

from .. import errors as E
from .abi import ENABLED_FEATURES
from .vulkan_info import DeviceInfo, query_devices

ENV_DEVICE = "KVDICT_VK_DEVICE"

_LOCK = threading.Lock()
_DEVICES: list[DeviceInfo] | None = None
_OPEN: dict[int, "Device"] = {}


def list_devices(*, refresh: bool = False) -> list[DeviceInfo]:
    """Name, type, driver/vendor info, limits and heaps of every Vulkan device (cached;
    ``refresh`` asks the loader again)."""
    global _DEVICES
    with _LOCK:
        if _DEVICES is None or refresh:
            _DEVICES = query_devices()
        return list(_DEVICES)


def select_device(spec: int | str | None = None) -> DeviceInfo:
    """The device ``spec`` names (index or name substring); None → $KVDICT_VK_DEVICE → 0."""
    devices = list_devices()
    if not devices:
        raise E.DeviceNotFoundError("the Vulkan loader reports no physical device")
    if spec is None:
        spec = os.environ.get(ENV_DEVICE, "").strip() or 0
    names = ", ".join(f"{d.index}: {d.name}" for d in devices)
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        i = int(spec)
        if not 0 <= i < len(devices):
            raise E.DeviceNotFoundError(f"no Vulkan device {i} (have {names})")
        return devices[i]
    if not isinstance(spec, str):
        raise E.DeviceNotFoundError(f"device spec must be an index or a name, got {spec!r}")
    hits = [d for d in devices if spec.lower() in d.name.lower()]
    if not hits:
        raise E.DeviceNotFoundError(f"no Vulkan device matching {spec!r} (have {names})")
    return hits[0]


class Device:
    """A chosen physical device and its (shared) Kompute manager."""

    def __init__(self, info: DeviceInfo):
        self.info = info
        self._manager = None
        # Kompute's Manager and Vulkan's queue are not thread-safe (vkQueueSubmit needs
        # external synchronisation): every Kompute call on this device goes through guard(),
        # which holds this lock. Re-entrant, since guarded code may allocate or dispatch.
        self._lock = threading.RLock()
        self._submitter = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def manager(self) -> "kp.Manager":
        if self._manager is None:
            with self.guard("creating the Kompute manager"):
                if self._manager is None:
                    self._manager = kp.Manager(self.info.index)
        return self._manager

    def submit(self, *ops, what: str = "dispatch") -> None:
        """Record ``ops`` and evaluate them once, on the sequence this device reuses for
        one-off work (kvdict_vk.vk.submit says why not a new one per call)."""
        if self._submitter is None:
            from .submit import Submitter
            self._submitter = Submitter(self)
        self._submitter.submit(ops, what)

    @property
    def is_cpu(self) -> bool:
        return self.info.device_type == "cpu"

    def limit(self, name: str):
        return self.info.limits[name]

    def subgroup_operations(self) -> tuple:
        """The subgroup operation classes compute shaders may use (vulkan_info; none known:
        empty)."""
        return tuple(self.info.limits.get("subgroup_operations", ()))

    def reported_features(self) -> tuple:
        """The optional features (abi.FEATURES) the device reports (vulkan_info)."""
        return tuple(self.info.limits.get("optional_features", ()))

    def features(self) -> tuple:
        """The optional features a variant may use here: those the device reports that
        kp enables at device creation (scripts/kp_patch.py: ENABLED_FEATURES)."""
        return tuple(f for f in self.reported_features() if f in ENABLED_FEATURES)

    def shuffle_subgroup_size(self) -> int:
        """The subgroup size where compute shaders may use subgroup shuffles (the basic and
        shuffle operation classes, both reported for the compute stage), else 0."""
        ok = {"basic", "shuffle"} <= set(self.subgroup_operations())
        return self.info.limits.get("subgroup_size", 0) if ok else 0

    def shuffles_fit(self, lanes: int, local: int) -> bool:
        """Whether ``lanes`` neighbouring invocations of a ``local``-invocation workgroup can add
        by subgroup shuffles: a power of two within one subgroup, the workgroup whole subgroups."""
        size = self.shuffle_subgroup_size()
        pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
        return pow2(lanes) and pow2(size) and lanes <= size and local % size == 0

    @contextlib.contextmanager
    def guard(self, what: str):
        """Turn whatever Kompute raises (RuntimeError from Vulkan-Hpp, …) into a
        VulkanError that names the device and the operation. Serialises callers."""
        try:
            with self._lock:
                yield
        except E.KvDictError:
            raise
        except (RuntimeError, MemoryError) as e:  # Vulkan-Hpp errors arrive as RuntimeError
            raise E.VulkanError(f"{self.info.name}: {what}: {e}") from e

    def __repr__(self) -> str:
        return f"Device({self.info.index}: {self.info.name!r}, {self.info.device_type})"


def get_device(spec: "int | str | Device | None" = None) -> Device:
    """The shared :class:`Device` for ``spec`` (see :func:`select_device`)."""
    if isinstance(spec, Device):
        return spec
    info = select_device(spec)
    with _LOCK:
        dev = _OPEN.get(info.index)
        if dev is None:
            dev = _OPEN[info.index] = Device(info)
        return dev
