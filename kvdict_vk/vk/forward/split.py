"""A model's decode over an arena split by layers (issue 53): each device's part of a SplitArena
(one process) or a RankArena (one process a device, kvdict_vk.vk.ranks) runs its own layers as a
DeviceForward(layers=), one submission a token, and the residual stream goes from one part to
the next — through the host in one process, by the group's send and receive between ranks —,
as llama.cpp's ``--split-mode layer`` hands it on. The last part's greedy token is every
caller's.

A head split would need every layer's attention outputs exchanged before its O projection (a
collective a layer, inside the token); it is refused.
"""
from __future__ import annotations

import numpy as np

from ... import errors as E
from .model import DeviceForward
from .weights import ModelWeights


class SplitForward:
    def __init__(self, weights: ModelWeights, arena, *, logits: bool = False, **forward_kw):
        """``weights``' decode over ``arena`` (a SplitArena or RankArena with ``split="layer"``):
        a DeviceForward for each part held here, DeviceForward's keywords; ``logits``: the
        last part reads them back (:meth:`logits`, where that part is held here)."""
        if arena.split != "layer":
            raise E.ArenaError("a device forward over a head split would exchange every layer's attention "
                               "outputs inside the token: split the arena by layers")
        self.arena, self.config = arena, weights.config
        self.parts: list[DeviceForward] = []
        try:
            for p in arena.parts:
                last = p.layers[1] == weights.config.n_layers
                self.parts.append(DeviceForward(weights, p.arena, layers=p.layers, logits=logits and last,
                                                **forward_kw))
        except BaseException:
            self.free()
            raise

    def run(self, token: int) -> int:
        """Feed ``token`` through every part, in layer order, and return the greedy next token
        (on every rank). Checked alike everywhere before any part runs: a token outside the
        vocabulary is a ShapeError, a full sequence an ArenaError."""
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) \
                or not 0 <= int(token) < self.config.vocab:
            raise E.ShapeError(f"SplitForward.run: token {token!r} outside 0..{self.config.vocab - 1}")
        n_ctx = self.arena.parts[0].arena.seq_ctx
        if any(self.arena.n_tokens(i) >= n_ctx for i in range(self.arena.n_layers)):
            raise E.ArenaError(f"the sequence is full ({n_ctx} tokens)")
        for f in self.parts:
            f.step.stage_lengths()  # the parts' own check, before any part runs
        stages = [lambda x, f=f: f.run_part(int(token), x) for f in self.parts]
        nxt = self.arena._hand_on(stages, self.config.hidden)  # noqa: SLF001 — the arena's exchange
        self.arena._advanced(range(self.arena.n_layers))  # noqa: SLF001
        return nxt

    def logits(self) -> np.ndarray:
        """The last run's logits, where the last part is held here (and logits=True)."""
        last = [f for f in self.parts if f.last]
        if not last:
            raise E.ArenaError("the last layers are held by another rank: its SplitForward has the logits")
        return last[0].logits()

    def gpu_seconds(self) -> list:
        """Each part's GPU time of the last run (None where made without timestamps)."""
        return [f.gpu_seconds() for f in self.parts]

    @property
    def weight_bytes(self) -> list[int]:
        """Bytes of weights resident on each device held here."""
        return [f.weight_bytes for f in self.parts]

    def free(self) -> None:
        for f in self.parts:
            f.free()
        self.parts = []

    def __enter__(self) -> "SplitForward":
        return self

    def __exit__(self, *exc) -> None:
        self.free()
