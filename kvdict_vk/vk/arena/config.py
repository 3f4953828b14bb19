"""What a KvArena is made with, before anything reaches the device: the cache it gets (the
runtime switch, $KVDICT_VK_CACHE), the encoder of its appends ($KVDICT_VK_ENCODER), its
sequence count, and the sizes its memory and write paths are bounded by.

The size constants are read when an arena is made (ArenaMemory) or written to (ArenaWrites),
so a test may shrink them to exercise the chunked paths.
"""
from __future__ import annotations

import os

from ... import errors as E
from ... import layout as L

CACHE_ENV = "KVDICT_VK_CACHE"  # the uncoded cache's row format when the switch is off: f16 / f32
ENCODERS = ("cpu", "gpu", "auto")
ENCODER_ENV = "KVDICT_VK_ENCODER"  # default of KvArena(encoder=None): "cpu", "gpu" or "auto"
MAX_SEQS = 1024  # sequences a batched arena holds at most

UPLOAD_CAP_WORDS = 1 << 20  # host-visible upload buffer, at most (4 MiB); larger appends are chunked
OUT_MIN_WORDS = 1 << 14  # smallest read-back buffer class (64 KiB) …
OUT_CLASS_STEP = 8  # … then ×8 per class, so a read copies back at most ~8× what it returns
OUT_CAP_WORDS = 1 << 24  # … up to 64 MiB (and the device limits); larger reads are chunked
SMALL_SCATTER_TOKENS = 4  # appends up to this many tokens use the small scatter pipeline
GPU_ENCODE_BATCH = 1024  # vectors per GPU-encoder submission (bounds its work buffers to ~1–2 MiB)


def resolve_cache(cache: str | None, dict_active: bool) -> str:
    """The cache an arena gets: "dict", "kivi", or an uncoded row format (KvArena's ``cache``)."""
    if cache is None:
        if dict_active:
            return "dict"
        cache = os.environ.get(CACHE_ENV, "").strip().lower() or L.DEFAULT_CACHE
    if cache == "dict":
        if not dict_active:
            raise E.ArenaError("cache='dict' needs an active dictionary (kvdict_vk.runtime.activate)")
        return cache
    if cache not in L.CACHES + (L.KIVI_CACHE,):
        raise E.ArenaError(f"cache must be None, 'dict' or one of {L.CACHES + (L.KIVI_CACHE,)} (or ${CACHE_ENV}), "
                           f"got {cache!r}")
    return cache


def resolve_encoder(encoder: str | None) -> str:
    """Where an arena's appends run OMP (KvArena's ``encoder``; None: $KVDICT_VK_ENCODER, else "auto")."""
    if encoder is None:
        encoder = os.environ.get(ENCODER_ENV, "").strip().lower() or "auto"
    if encoder not in ENCODERS:
        raise E.ArenaError(f"encoder must be one of {ENCODERS} (or ${ENCODER_ENV}), got {encoder!r}")
    return encoder


def check_seqs(seqs: int, n_ctx: int) -> None:
    """KvArena's ``seqs``: positive, at most MAX_SEQS."""
    L.check_positive(seqs=seqs, n_ctx=n_ctx)  # before n_ctx · seqs rows per head are laid out
    if seqs > MAX_SEQS:
        raise E.ArenaError(f"seqs must be at most {MAX_SEQS}, got {seqs}")
