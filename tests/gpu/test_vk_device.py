"""Device choice, device facts, Kompute data round-trips, typed dispatch errors."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvdict_vk import errors as E

pytestmark = pytest.mark.gpu


def test_list_devices_reports_limits(vk_device):
    from kvdict_vk.vk import list_devices
    devs = list_devices()
    assert devs and devs[0].index == 0
    info = vk_device.info
    assert info.name and info.device_type in {"cpu", "discrete-gpu", "integrated-gpu", "virtual-gpu", "other"}
    lim = info.limits
    assert lim["max_storage_buffer_range"] >= 1 << 27  # Vulkan minimum: 2^27 bytes
    assert min(lim["max_compute_work_group_count"]) >= 65535
    assert lim["max_compute_work_group_invocations"] >= 128
    assert lim["max_push_constants_size"] >= 128
    assert info.device_local_bytes > 0
    d = info.to_dict()
    assert d["name"] == info.name and d["heaps"]
    # multiprocessors: NVIDIA's (Turing on: VK_NV_shader_sm_builtins) and AMD's drivers report
    # them through their extensions, a CPU driver has neither (0: unknown)
    cus = lim["compute_units"]
    assert isinstance(cus, int) and cus >= 0
    if info.vendor_id in (0x10DE, 0x1002) and info.device_type == "discrete-gpu":
        assert cus > 0
    if info.device_type == "cpu":
        assert cus == 0


def test_expected_driver_is_the_one_used(vk_device):
    want = os.environ.get("KVDICT_EXPECT_DRIVER")
    if not want:
        pytest.skip("KVDICT_EXPECT_DRIVER not set (make test sets it)")
    info = vk_device.info
    seen = f"{info.name} {info.driver_name} {info.driver_info}"
    assert want.lower() in seen.lower(), f"expected a {want!r} device, got {seen!r}"


def test_device_selection(monkeypatch, vk_device):
    from kvdict_vk.vk.device import ENV_DEVICE, get_device, list_devices, select_device
    first = list_devices()[0]
    monkeypatch.delenv(ENV_DEVICE, raising=False)
    assert select_device().index == 0
    monkeypatch.setenv(ENV_DEVICE, "0")
    assert select_device().index == 0
    monkeypatch.setenv(ENV_DEVICE, first.name.split()[0].upper())  # case-insensitive substring
    assert select_device().name == first.name
    assert get_device() is get_device(0)  # one shared manager per device
    for bad in ("99", "no-such-gpu-anywhere"):
        monkeypatch.setenv(ENV_DEVICE, bad)
        with pytest.raises(E.DeviceNotFoundError):
            select_device()
    with pytest.raises(E.DeviceNotFoundError):
        select_device(3.5)


@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize("dtype", [np.uint32, np.float32])
def test_kp_tensor_data_round_trips_under_numpy2(vk_device, kind, dtype):
    """Debian's pybind11 2.10 silently corrupts Tensor.data() under numpy 2 (docs/DESIGN.md)."""
    from kvdict_vk.vk.device import kp
    rng = np.random.default_rng(0)
    if dtype is np.uint32:
        data = rng.integers(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32)
    else:
        data = rng.standard_normal(4099).astype(np.float32)
        data[:3] = [np.inf, -0.0, np.nan]
    mgr = vk_device.manager
    t = mgr.tensor_t(data, getattr(kp.TensorTypes, kind))
    assert t.size() == data.size
    got = t.data()
    assert got.dtype == dtype and np.array_equal(got.view(np.uint32), data.view(np.uint32))
    mgr.sequence().eval(kp.OpTensorSyncDevice([t]))
    t.data()[:] = 0
    if kind == "device":  # device → staging overwrites the zeros with the device copy
        mgr.sequence().eval(kp.OpTensorSyncLocal([t]))
        assert np.array_equal(t.data().view(np.uint32), data.view(np.uint32))
    t.destroy()


def test_shader_copy_is_bit_exact(vk_device):
    from kvdict_vk.vk.kernels import Buffer, Kernel, run
    from kvdict_vk.vk.device import kp
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2 ** 32, 1 << 12, dtype=np.uint64).astype(np.uint32)
    src = Buffer(vk_device, words.size, "host", "src", words)
    dst = Buffer(vk_device, words.size, "device", "dst")
    for variant in ("copy_vec4", "copy_scalar"):
        k = Kernel(vk_device, variant, [src, dst], max_items=words.size)
        run(vk_device, k.op(src_word=8, dst_word=0, n_words=words.size - 8), kp.OpTensorSyncLocal([dst.tensor]))
        assert np.array_equal(dst.host_words()[:words.size - 8], words[8:])
        k.destroy()
    src.destroy()
    dst.destroy()


def test_dispatch_contract_is_checked_before_the_driver(vk_device):
    """Wrong binding count, push constants, specialization, spans or alignment → DispatchError
    (Kompute itself would segfault on too few tensors)."""
    from kvdict_vk.vk.kernels import Buffer, Kernel
    a = Buffer(vk_device, 256, "storage", "a")
    b = Buffer(vk_device, 256, "device", "b")
    spec = {"HEAD_DIM": 16, "SPARSITY": 2, "CHUNKS": 1}
    with pytest.raises(E.DispatchError, match="binds 4"):
        Kernel(vk_device, "reconstruct_vec4", [a, b], spec)
    with pytest.raises(E.DispatchError, match="specialization"):
        Kernel(vk_device, "reconstruct_vec4", [a, a, b, a], {"HEAD_DIM": 16})
    with pytest.raises(E.DispatchError, match="HEAD_DIM"):
        Kernel(vk_device, "reconstruct_vec4", [a, a, b, a], {**spec, "HEAD_DIM": 18})
    with pytest.raises(E.DispatchError, match="HEAD_DIM"):
        Kernel(vk_device, "reconstruct_vec4", [a, a, b, a], {**spec, "CHUNKS": 3})
    with pytest.raises(E.DispatchError, match="positive"):
        Kernel(vk_device, "reconstruct_vec4", [a, a, b, a], {**spec, "SPARSITY": 0})
    with pytest.raises(E.DispatchError, match="also bound"):
        Kernel(vk_device, "reconstruct_vec4", [b, a, b, a], spec)  # output aliases an input
    k = Kernel(vk_device, "reconstruct_vec4", [a, a, b, a], spec)
    ok = dict(src_word=0, atoms_word=64, mean_word=192, n_atoms=8, n_ctx=4, t0=0, n_tok=2, n_rows=4, out_word=0)
    k.op(**ok)
    for bad, match in [(dict(n_atoms=13), "binding 1"), (dict(out_word=200), "binding 2"),
                       (dict(mean_word=193), "vec4-aligned"), (dict(t0=3), "inconsistent"),
                       (dict(n_rows=3), "inconsistent"), (dict(n_atoms=0), "n_atoms")]:
        with pytest.raises(E.DispatchError, match=match):
            k.op(**{**ok, **bad})
    # binary16 atoms (ATOMS_F16): the atoms block read through binding 3, as halves
    k16 = Kernel(vk_device, "reconstruct_vec4", [a, a, b, a], {**spec, "ATOMS_F16": 1})
    ok16 = {**ok, "n_atoms": 13, "atoms_word": 128}  # 13 atoms × 16 halves = 104 words
    k16.op(**ok16)
    for bad, match in [(dict(atoms_word=200), "binding 3"), (dict(atoms_word=129), "aligned")]:
        with pytest.raises(E.DispatchError, match=match):
            k16.op(**{**ok16, **bad})
    # binary16 atoms are gathered a quad (8 halves) at a time: the vec4 variant, head_dim % 8 == 0
    for variant, s16 in (("reconstruct_vec4", {**spec, "HEAD_DIM": 12, "ATOMS_F16": 1}),
                         ("reconstruct_scalar", {**spec, "ATOMS_F16": 1})):
        bad16 = Kernel(vk_device, variant, [a, a, b, a], s16)
        with pytest.raises(E.DispatchError, match="quad"):
            bad16.op(**{**ok16, "n_atoms": 4})
        bad16.destroy()
    k16.destroy()
    with pytest.raises(E.DispatchError):
        k.op(**{n: v for n, v in ok.items() if n != "t0"})
    c = Kernel(vk_device, "copy_vec4", [a, b])
    with pytest.raises(E.DispatchError, match="vec4-aligned"):
        c.op(src_word=2, dst_word=0, n_words=8)
    a.destroy()
    with pytest.raises(E.DispatchError, match="freed"):
        c.op(src_word=0, dst_word=0, n_words=8)
    for x in (k, c):
        x.destroy()
    b.destroy()


def test_optional_features_are_read_and_gate_the_variants_that_need_them(vk_device, monkeypatch):
    """vulkan_info reads the optional features (abi.FEATURES) from the driver's feature structs;
    lavapipe (Mesa 22.3) reports every one but cooperative matrices, an NVIDIA H100/H200 all of
    them. kp enables ENABLED_FEATURES of those at device creation (scripts/kp_patch.py: the
    session's validation gate would flag a shader using one that is not). A variant that
    declares a feature the device lacks is refused with a typed error before the driver sees it."""
    from kvdict_vk.vk import abi, kernels, shaders
    reported = vk_device.reported_features()
    assert set(reported) <= set(abi.FEATURES) and set(vk_device.features()) == set(reported) & set(abi.ENABLED_FEATURES)
    if vk_device.info.driver_name.lower().startswith("llvmpipe") or "llvmpipe" in vk_device.name:
        assert set(reported) == {"float16", "int8", "integer_dot", "float_atomics"}
    a = kernels.Buffer(vk_device, 64, "storage", "a")
    b = kernels.Buffer(vk_device, 64, "storage", "b")
    try:
        import dataclasses
        real = shaders.spec
        spec = real("copy_vec4")
        needs = dataclasses.replace(spec, decl=dataclasses.replace(spec.decl, features=("float16",)))
        monkeypatch.setattr(shaders, "spec", lambda name: needs if name == "copy_vec4" else real(name))
        monkeypatch.setattr(type(vk_device), "features", lambda self: ())
        with pytest.raises(E.DispatchError, match="float16"):
            kernels.Kernel(vk_device, "copy_vec4", [a, b], max_items=16)
        monkeypatch.setattr(type(vk_device), "features", lambda self: ("float16",))
        k = kernels.Kernel(vk_device, "copy_vec4", [a, b], max_items=16)
        k.destroy()
    finally:
        a.destroy()
        b.destroy()
