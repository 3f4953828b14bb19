"""The device's pipeline cache (kvdict_vk.vk.kernels.pipeline): one pipeline per variant,
specialization, bound buffers and size, shared by every owner that asks for it, freed with
the first of its buffers — so owners keep none and a freed arena leaves none behind."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk.vk import KvArena
from kvdict_vk.vk import kernels as K

pytestmark = pytest.mark.gpu


def test_same_request_same_pipeline_and_freed_with_its_buffers(vk_device):
    before = K.pipeline_count(vk_device)
    src = K.Buffer(vk_device, 64, "storage", "src")
    dst = K.Buffer(vk_device, 64, "device", "dst")
    other = K.Buffer(vk_device, 64, "device", "other")
    try:
        a = K.pipeline(vk_device, "copy_scalar", [src, dst], max_items=64)
        assert K.pipeline(vk_device, "copy_scalar", [src, dst], max_items=64) is a
        b = K.pipeline(vk_device, "copy_scalar", [src, other], max_items=64)  # other buffers
        c = K.pipeline(vk_device, "copy_scalar", [src, dst], max_items=16)  # another size
        assert len({id(a), id(b), id(c)}) == 3
        assert K.pipeline_count(vk_device) == before + 3
        dst.destroy()  # a and c bind it
        assert a.algorithm is None and c.algorithm is None and b.algorithm is not None
        assert K.pipeline_count(vk_device) == before + 1
        K.release(b)
        assert b.algorithm is None and K.pipeline_count(vk_device) == before
    finally:
        for buf in (src, dst, other):
            buf.destroy()
    assert K.pipeline_count(vk_device) == before


def test_a_bad_request_caches_nothing(vk_device):
    before = K.pipeline_count(vk_device)
    src = K.Buffer(vk_device, 64, "storage", "src")
    try:
        with pytest.raises(E.DispatchError):
            K.pipeline(vk_device, "copy_scalar", [src], max_items=64)  # binds two buffers
        with pytest.raises(E.DispatchError):
            K.pipeline(vk_device, "no_such_variant", [src, src])
        assert K.pipeline_count(vk_device) == before
    finally:
        src.destroy()


@pytest.mark.parametrize("cache", ["f16", "q8_0", "kivi"])
def test_an_arena_shares_and_then_leaves_no_pipeline(vk_device, cache):
    rng = np.random.default_rng(5)
    before = K.pipeline_count(vk_device)
    arena = KvArena(2, 2, 32, 256, cache=cache, device=vk_device)
    try:
        rows = rng.standard_normal((2, 40, 32), dtype=np.float32)
        arena.append(0, rows, rows)
        arena.read(0, 0, 40)
        made = K.pipeline_count(vk_device)
        arena.read(0, 0, 40)  # the read plan's pipelines again: none new
        arena.read_plan(0, 0, 40).run()
        assert K.pipeline_count(vk_device) == made
        q = rng.standard_normal((4, 32), dtype=np.float32)
        arena.attend(0, q, 40)
        with_attention = K.pipeline_count(vk_device)
        arena.attend(0, q, 40)
        assert K.pipeline_count(vk_device) == with_attention
    finally:
        arena.free()
    assert K.pipeline_count(vk_device) == before
