"""Row formats' words: what an uncoded cache stores for float32 rows (f32 bits, f16 pairs,
q8_0 blocks), a dictionary's binary16 atoms (chunk-pair order), and a layer's
tail image — the numbers kvdict_vk.layout places, as uint32 words ready to upload.

Pure NumPy, no GPU import (the dump tool and the tests read them too).
"""
from __future__ import annotations

import numpy as np

from . import errors as E
from . import rope
from .dictionary import is_f16_exact
from .kivi import GROUP as KIVI_GROUP
from .layout import ATOMS_F16_ELEMS, CACHES, Q8_BLOCK, ArenaLayout, StreamLayout, q8_scale_words


# what a recorded step's append_step turns a stream's source rows into (shaders/append_step.comp's
# FORMAT_*): the words as given (f32 rows, a coded stream's slots), or float32 rows made into
# binary16 or q8_0 words on the device, bit for bit as row_words_of makes them
APPEND_FORMATS = {"words": 0, "f16": 1, "q8_0": 2}
# what shaders/fwd_qkv.comp writes a layer's token as (its row_format): the append formats, and a
# KIVI layer's rings and groups (kivi_append.glsl, QKV_KIVI)
QKV_FORMATS = {**APPEND_FORMATS, "kivi": 3}
# those whose unit (a q8_0 pair of blocks, a KIVI head) several workgroups make: appended through
# the step's source rows and arrival words, the workgroup completing a unit encoding it
QKV_THROUGH_ROWS = ("q8_0", "kivi")
# the widest KIVI head fwd_qkv appends: a group's rows of one stream (GROUP binary16 rows) staged
# in its matvec stage of MATVEC_STAGE_WORDS (matvec.glsl's X_SHARED; kivi_append.glsl); wider heads
# keep the step's append_kivi
MATVEC_STAGE_WORDS = 2048
QKV_KIVI_MAX_HEAD_DIM = 2 * MATVEC_STAGE_WORDS // KIVI_GROUP


def qkv_arrival_words(n_kv: int, head_dim: int) -> int:
    """fwd_qkv's arrival words for a layer: one a (stream, KV head, pair of q8_0 blocks) — as many
    as a KIVI layer's one a KV head needs and more."""
    return 2 * n_kv * q8_scale_words(head_dim)


def append_format(st: StreamLayout) -> str:
    """The APPEND_FORMATS key of a stream: what its recorded appends convert on the device."""
    if st.coded or not (st.half or st.q8):
        return "words"
    return "f16" if st.half else "q8_0"


def row_words_of(rows: np.ndarray, st: StreamLayout) -> np.ndarray:
    """The words a passthrough stream stores for float32 rows (n_kv, T, head_dim): their
    bits (f32), the halves packed two to a word (f16: round to nearest even, as numpy), or
    q8_0 rows (q8_0_words)."""
    rows = np.ascontiguousarray(rows, np.float32)
    if st.coded:
        raise E.ArenaError(f"layer {st.layer} {st.stream}: a coded stream stores slots, not rows")
    if st.half:
        return rows.astype(np.float16).view(np.uint32)
    if st.q8:
        return q8_0_words(rows)
    return rows.view(np.uint32)


def held_rows(rows: np.ndarray, fmt: str) -> np.ndarray:
    """What an uncoded cache in row format ``fmt`` holds for float32 rows (…, head_dim),
    as float32: the rows (f32), their f16 rounding, or their q8_0 round trip."""
    x = np.asarray(rows, np.float32)
    if fmt == "f16":
        return x.astype(np.float16).astype(np.float32)
    if fmt == "q8_0":
        return q8_0_rows(q8_0_words(x), x.shape[-1])
    if fmt != "f32":
        raise E.ArenaError(f"no uncoded row format {fmt!r} (have {CACHES})")
    return x


def q8_0_words(rows: np.ndarray) -> np.ndarray:
    """q8_0 rows (…, head_dim) → words (…, row_words): llama.cpp's quantisation — per block
    of 32, d = max|x| / 127 and q = round(x / d) half away from zero (0 for an all-zero
    block), d kept as f16 — laid out as the block scales (f16 pairs, block 2k in the low
    half) then the int8 values four to a word (element 4k in the low byte). Finite input."""
    x = np.asarray(rows, np.float32)
    hd = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], hd // Q8_BLOCK, Q8_BLOCK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.trunc(blocks * inv[..., None] + np.copysign(np.float32(0.5), blocks)).astype(np.int8)
    scales = d.astype(np.float16)
    if scales.shape[-1] % 2:
        scales = np.concatenate([scales, np.zeros(scales.shape[:-1] + (1,), np.float16)], axis=-1)
    scale_words = np.ascontiguousarray(scales).view(np.uint32)
    value_words = np.ascontiguousarray(q.reshape(*x.shape[:-1], hd)).view(np.uint32)
    return np.concatenate([scale_words, value_words], axis=-1)


def q8_0_rows(words: np.ndarray, head_dim: int) -> np.ndarray:
    """The float32 rows q8_0 words decode to: q · d, d the block's f16 scale (the twin of
    read_rows_q8.comp and attend_flash.comp's q8_0 rows)."""
    w = np.ascontiguousarray(words, np.uint32)
    sw = q8_scale_words(head_dim)
    d = w[..., :sw].view(np.float16)[..., :head_dim // Q8_BLOCK].astype(np.float32)
    q = w[..., sw:].view(np.int8).astype(np.float32).reshape(*w.shape[:-1], head_dim // Q8_BLOCK, Q8_BLOCK)
    return (q * d[..., None]).reshape(*w.shape[:-1], head_dim)


def atoms_f16_order(head_dim: int) -> np.ndarray:
    """The element order of a binary16 atom in the arena: quad p (halves 8p … 8p+7) holds
    elements 4p … 4p+3 and head_dim/2 + 4p … head_dim/2 + 4p+3 — output chunks p and p +
    head_dim/8 of a row, which reconstruct's invocations write (neighbouring invocations
    neighbouring chunks, coalesced) from one 16-byte gather. head_dim % 8 == 0."""
    if head_dim % ATOMS_F16_ELEMS:
        raise E.ArenaError(f"binary16 atoms need head_dim % {ATOMS_F16_ELEMS} == 0, not {head_dim}")
    quads = np.arange(head_dim // ATOMS_F16_ELEMS)[:, None]
    lanes = np.arange(4)[None, :]
    return np.concatenate([4 * quads + lanes, head_dim // 2 + 4 * quads + lanes], axis=1).reshape(-1)


def layer_tail_image(layout: ArenaLayout, layer: int, atoms_flat: np.ndarray | None,
                     means: tuple, scales: tuple = (None, None)) -> np.ndarray:
    """The words of one layer's tail (uint32), ready to upload at ``tail_word``: K atoms,
    V atoms (binary16 in chunk-pair order, ``atoms_f16_order``, where the layout keeps them
    so; else float32), K mean, V mean, K residual scale, V residual scale (zeros for
    passthrough / absent); guards in between if any.

    ``atoms_flat`` is the runtime's ``atoms_flat()`` array; ``means`` and ``scales`` the
    layer's (K, V) pairs, each None or an array broadcastable to (n_dict_heads, head_dim)."""
    ll = layout.layers[layer]
    if ll.tail_word is None:
        raise E.ArenaError("the uncoded layout has no tail")
    img = np.full(ll.tail_words, layout.guard_value, np.uint32)
    g, hd = layout.n_dict_heads, layout.head_dim
    block = g * layout.n_atoms * hd
    flat = np.asarray(atoms_flat, np.float32)
    if flat.size != layout.n_layers * 2 * block:
        raise E.DictMismatchError(f"atoms_flat has {flat.size} floats, the layout expects "
                                  f"{layout.n_layers} × 2 × {block}")
    flat = flat.reshape(layout.n_layers, 2, block)
    for j, st in enumerate(ll.streams):
        a0 = st.atoms_word - ll.tail_word
        if st.atoms_f16:
            if not is_f16_exact(flat[layer, j]):
                raise E.DictMismatchError(f"layer {layer} {st.stream}: the layout keeps binary16 atoms, "
                                          "these atoms are not all binary16 values")
            atoms = flat[layer, j].reshape(-1, hd)[:, atoms_f16_order(hd)]
            img[a0:a0 + block // 2] = atoms.astype(np.float16).reshape(-1).view(np.uint32)
        else:
            img[a0:a0 + block] = flat[layer, j].view(np.uint32)
        for word, vec in ((st.mean_word, means[j]), (st.scale_word, scales[j])):
            v = np.zeros((g, hd), np.float32) if vec is None else np.broadcast_to(np.asarray(vec, np.float32), (g, hd))
            img[word - ll.tail_word:word - ll.tail_word + g * hd] = np.ascontiguousarray(v).reshape(-1).view(np.uint32)
        if st.key_rope is not None:
            r0 = st.rope_word - ll.tail_word
            img[r0:r0 + st.rope_words] = rope.table(st.key_rope, st.n_ctx, hd).reshape(-1).view(np.uint32)
    return img
