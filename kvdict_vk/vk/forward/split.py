"""A model's decode over a split arena (issue 53), each device's part of a SplitArena (one
process) or a RankArena (one process a device, kvdict_vk.vk.ranks) a DeviceForward of its own.

By layers: each part runs its own layers (DeviceForward(layers=)), one submission a token, and
the residual stream goes from one part to the next — through the host in one process, by the
group's send and receive between ranks —, as llama.cpp's ``--split-mode layer`` hands it on. The
last part's greedy token is every caller's.

By KV heads: each part computes Q, K and V of its heads, appends and attends over them
(DeviceForward(heads=)); after every layer's attention the parts' outputs are gathered (in one
process: joined on the host; between ranks: an all-gather) and every part runs the layer's O
projection over all of them and the rest of the layer, the MLP and the LM head whole — a
submission a layer and a part, the price of a cache spread by heads. Every part then picks the
same next token (the same numbers through the same kernels: parts on devices of one kind).
"""
from __future__ import annotations

import numpy as np

from ... import errors as E
from .model import DeviceForward
from .weights import ModelWeights


class SplitForward:
    def __init__(self, weights: ModelWeights, arena, *, logits: bool = False, **forward_kw):
        """``weights``' decode over ``arena`` (a SplitArena or a RankArena, either split): a
        DeviceForward for each part held here, DeviceForward's keywords; ``logits``: the part
        with the last layers reads them back (:meth:`logits`, where that part is held here)."""
        self.arena, self.config = arena, weights.config
        self.parts: list[DeviceForward] = []
        try:
            for p in arena.parts:
                last = p.layers[1] == weights.config.n_layers
                self.parts.append(DeviceForward(weights, p.arena, layers=p.layers, heads=p.heads,
                                                logits=logits and last, **forward_kw))
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
        self.arena._check_room_all(range(self.arena.n_layers))  # noqa: SLF001 — alike on every rank
        if self.arena.split == "head":
            nxt = self._run_heads(int(token))
        else:
            stages = [lambda x, f=f: f.run_part(int(token), x) for f in self.parts]
            nxt = self.arena._hand_on(stages, self.config.hidden)  # noqa: SLF001 — the arena's exchange
        self.arena._advanced(range(self.arena.n_layers))  # noqa: SLF001
        return nxt

    def _run_heads(self, token: int) -> int:
        """A head split's token: every part's segment i at once, then their attention outputs
        gathered into every part, layer by layer; the first part's pick."""
        each = lambda call: self.arena._concurrently(call, self.parts)  # noqa: E731, SLF001
        for f in self.parts:
            f.begin(token)
        for i in range(self.config.n_layers):
            full = self.arena._gather_heads(each(lambda f: f.run_segment(i)))  # noqa: SLF001
            for f in self.parts:
                f.set_gathered(full)
        return each(lambda f: f.run_segment(self.config.n_layers))[0]

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
