"""A KV arena split over torch.distributed ranks, one process a device (issue 53): the ranks of a
process group hold the parts a SplitArena's devices would (kvdict_vk.vk.split: by layers or by
KV heads), each on its own Vulkan device, and exchange what a decode needs through the group's
collectives — gloo on CPUs, NCCL where CUDA is there — so the same code runs across hosts.

Every rank makes the same calls with the same arguments (the hidden state, and so the new rows
and queries, are every rank's), and every call hands back on every rank what one device's
arena would: a head split's parts each give their KV heads' outputs, gathered; a layer split's
owner of the layer gives its result, broadcast. A recorded step's outputs (SplitStep.run) come
back by one all-reduce over a token's output block, each rank's heads and layers written and
the rest zero (a sum with zeros is exact). A refusal is raised on every rank: inputs are
checked alike on each before any device acts, and an owner's error is handed to the others.

torch is an optional extra (``pip install .[distributed]``); without it, or without an
initialised process group, a RankArena is refused with DistributedError.

    torch.distributed.init_process_group("gloo", ...)
    arena = RankArena(30, 3, 64, 8192, "llvmpipe", split="head")
"""
from __future__ import annotations

import time

import numpy as np

from .. import errors as E
from .device import Device, get_device
from .split import SplitArena


def _distributed():
    """torch.distributed with an initialised default group, or DistributedError."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise E.DistributedError("a RankArena needs torch (the distributed extra: pip install "
                                 "'kvdict_vk[distributed]')") from exc
    if not dist.is_available() or not dist.is_initialized():
        raise E.DistributedError("a RankArena needs an initialised torch.distributed process group "
                                 "(torch.distributed.init_process_group)")
    return dist


class RankArena(SplitArena):
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, device=None, *,
                 split: str = "layer", group=None, **arena_kw):
        """This rank's part of a split over the ranks of ``group`` (default: the whole world):
        part i on rank i, on ``device`` (a Device or a device spec; None: the default one).
        KvArena's dims and keywords, as SplitArena takes them; a collective call: every rank
        makes it."""
        dist = _distributed()
        self._dist, self._group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world)]
        self._tensors = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self.exchange_s = 0.0  # time spent in the group's collectives, all calls
        dev = device if isinstance(device, Device) else get_device(device)
        self._remote = np.zeros(n_layers, np.int64)  # tokens a layer holds, where another rank holds it
        outcome = self._outcome(lambda: self._build(n_layers, n_kv_heads, head_dim, n_ctx, split, {self.rank: dev},
                                                    self.world, arena_kw))
        try:
            self._agree(outcome)  # every rank refuses where any does
        except BaseException:
            self.free()
            raise

    # --- the exchange -----------------------------------------------------------------------
    def _outcome(self, call):
        """``call()``'s result, or the error it raised as it can travel to the other ranks
        (the project's typed errors as they are, anything else a DistributedError naming this
        rank) — for _agree or a broadcast to raise on every rank."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 — handed to every rank
            return exc if isinstance(exc, E.KvDictError) else \
                E.DistributedError(f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def _timed(self, collective, *args, **kw):
        t0 = time.perf_counter()
        try:
            return collective(*args, group=self._group, **kw)
        finally:
            self.exchange_s += time.perf_counter() - t0

    def _agree(self, outcome) -> list:
        """Every rank's outcome (a result, or the error its call raised), in rank order; the
        first error is raised on every rank."""
        gathered = [None] * self.world
        self._timed(self._dist.all_gather_object, gathered, outcome)
        for g in gathered:
            if isinstance(g, BaseException):
                raise g
        return gathered

    def _each(self, call) -> list:
        return self._agree(self._outcome(lambda: call(self.parts[0])))

    def _at_owner(self, layer: int, call):
        owner = self._owner_index(layer)
        box = [None, None]
        if owner == self.rank:
            part = self.parts[0]
            i = layer - part.layers[0]
            box = [self._outcome(lambda: call(part.arena, i)), part.arena.n_tokens(i)]
        self._timed(self._dist.broadcast_object_list, box, src=self._global[owner])
        self._remote[layer] = box[1]
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _combine(self, out: np.ndarray) -> np.ndarray:
        import torch
        t = torch.from_numpy(out).to(self._tensors)
        self._timed(self._dist.all_reduce, t)
        return t.cpu().numpy()

    def _advanced(self, layers) -> None:
        self._remote[list(layers)] += 1

    def _gather_heads(self, outs: list) -> np.ndarray:
        """This rank's heads' output gathered with every other rank's (padded to the largest
        part for the collective, cut back after), in rank order."""
        import torch
        (mine,) = outs
        sizes = [(h1 - h0) for _, (h0, h1) in self.cuts]
        per_head = mine.size // sizes[self.rank]
        pad = np.zeros(max(sizes) * per_head, np.float32)
        pad[:mine.size] = mine
        got = [torch.empty(pad.size, dtype=torch.float32, device=self._tensors) for _ in range(self.world)]
        self._timed(self._dist.all_gather, got, torch.from_numpy(pad).to(self._tensors))
        return np.concatenate([g.cpu().numpy()[:n * per_head] for g, n in zip(got, sizes)])

    def _hand_on(self, stages, width: int) -> int:
        """This rank's stage, taking the rank before's output (received) and sending its own
        to the rank after; the last rank's result broadcast to every rank."""
        import torch
        (stage,) = stages
        x = None
        if self.rank > 0:
            t = torch.empty(width, dtype=torch.float32, device=self._tensors)
            self._timed(self._dist.recv, t, src=self._global[self.rank - 1])
            x = t.cpu().numpy()
        out, last = stage(x), self.world - 1
        if self.rank < last:
            self._timed(self._dist.send, torch.from_numpy(out).to(self._tensors), dst=self._global[self.rank + 1])
        box = torch.tensor([int(out) if self.rank == last else 0], dtype=torch.int64, device=self._tensors)
        self._timed(self._dist.broadcast, box, src=self._global[last])
        return int(box.item())

    def record_step(self, n_heads: int, layers=None, scale: float | None = None, n_plan: int | None = None):
        """SplitArena.record_step on every rank, each recording its own layers and heads; a
        rank's refusal is every rank's."""
        outcome = self._outcome(lambda: super(RankArena, self).record_step(n_heads, layers, scale=scale,
                                                                           n_plan=n_plan))
        step = None if isinstance(outcome, BaseException) else outcome
        try:
            self._agree(None if step is not None else outcome)  # (a step stays on its rank)
        except BaseException:
            if step is not None:
                self._steps.remove(step)
                step.free()
            raise
        return step

    # --- where things live ------------------------------------------------------------------
    def n_tokens(self, layer: int) -> int:
        """Tokens ``layer`` holds: its part's count, or (a layer another rank holds) the count
        that rank handed back with its last call."""
        layer = self._layer(layer)
        part = self.parts[0]
        if part.layers[0] <= layer < part.layers[1]:
            return part.arena.n_tokens(layer - part.layers[0])
        return int(self._remote[layer])

    def _counts(self) -> np.ndarray:
        """Every layer's tokens: this rank's part's own counts, the others' as their owners
        handed them back."""
        counts, (a, b) = self._remote.copy(), self.parts[0].layers
        counts[a:b] = self.parts[0].arena.memory.counts(slice(None), 1)[:, 0]
        return counts

    @property
    def part(self):
        """This rank's part (split.Part)."""
        return self.parts[0]

