"""A KV arena split over several Vulkan devices in one process (issue 53): by layers — each
device holds a contiguous range of layers — or by KV heads — each device holds a range of every
layer's KV heads and the dictionaries of those heads (per-head ones cut to the range, a shared
one on every device). ``SplitArena`` takes KvArena's calls (append, append_codes, read, attend,
step, record_step) and hands back what one device's arena would; each device holds only its part, in an
arena of its own (kvdict_vk.vk.arena), installed from the runtime's one artifact.

A head split's parts work at once, a thread each: every device has its own queue and lock
(kvdict_vk.vk.device), and kp's ``Sequence.eval`` releases the GIL while it submits and waits
(scripts/kp_patch.py item 6). A layer split's layers run where they live, one device a layer,
as llama.cpp's ``--split-mode layer`` does; a recorded step over several layers (SplitStep)
runs every device's layers at once, a thread each, since its inputs are given together.

    devices = open_devices("llvmpipe", 2)     # two logical devices on one physical one
    arena = SplitArena(30, 3, 64, 8192, devices, split="head")
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import errors as E
from .. import runtime
from ..dictionary import KvDictArtifact, StreamDict
from .arena.arena import KvArena
from .arena import config as C
from .device import Device, get_device, select_device

SPLITS = ("layer", "head")


def open_devices(spec=None, n: int = 2) -> list[Device]:
    """``n`` logical devices on the physical device ``spec`` names (kvdict_vk.vk.device's
    forms): the process's shared one, then ``n − 1`` more, each with its own Kompute manager
    (its own VkDevice and queue) — several devices where one card, or lavapipe, is there."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise E.ArenaError(f"open_devices: n must be a positive integer, got {n!r}")
    first = get_device(spec)
    return [first] + [Device(select_device(first.info.index)) for _ in range(n - 1)]


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering 0 … n − 1, their sizes differing by at most one."""
    if not 1 <= parts <= n:
        raise E.ArenaError(f"cannot split {n} into {parts} non-empty parts")
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def artifact_part(art: KvDictArtifact, layers: tuple[int, int] | None = None,
                  heads: tuple[int, int] | None = None) -> KvDictArtifact:
    """The part of ``art`` one device holds: layers [a, b) of it, and/or KV heads [h0, h1) of
    every layer (per-head dictionaries cut to those heads; a shared one kept whole). KvArena
    takes it (``dictionary_part``) only from the artifact the runtime has installed."""
    a, b = layers or (0, art.n_layers)
    h0, h1 = heads or (0, None)

    def cut(d: StreamDict | None):
        if d is None or d.n_heads == 1 or heads is None:
            return d
        return dataclasses.replace(d, atoms=d.atoms[h0:h1], mean=None if d.mean is None else d.mean[h0:h1],
                                   residual_scale=None if d.residual_scale is None else d.residual_scale[h0:h1])
    part = KvDictArtifact(art.head_dim, art.n_atoms, art.sparsity,
                          tuple((cut(k), cut(v)) for k, v in art.layers[a:b]), art.window, art.key_rope)
    object.__setattr__(part, "part_of", art)  # what KvArena checks: cut from the installed one
    return part


def part_cuts(split: str, n_layers: int, n_kv_heads: int, parts: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each part's (layers [a, b), KV heads [h0, h1)) of a ``split`` over ``parts`` devices."""
    if split == "layer":
        return [(r, (0, n_kv_heads)) for r in ranges(n_layers, parts)]
    return [((0, n_layers), r) for r in ranges(n_kv_heads, parts)]


@dataclasses.dataclass(frozen=True)
class Part:
    """One device's part: its arena, the layers [a, b) and the KV heads [h0, h1) it holds."""
    arena: KvArena
    layers: tuple[int, int]
    heads: tuple[int, int]


class SplitArena:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, devices, *,
                 split: str = "layer", **arena_kw):
        """KvArena's dims and keywords (``cache``, ``encoder``, ``guard_words`` …; one
        sequence), spread over ``devices`` (a list of Device or device specs; open_devices
        makes several of one): ``split`` "layer" (each a contiguous range of layers) or "head"
        (each a range of every layer's KV heads). The runtime snapshot is read once, as KvArena
        reads it; a device without room (ArenaTooLargeError) frees every part made before."""
        devices = [d if isinstance(d, Device) else get_device(d) for d in devices]
        if len({id(d) for d in devices}) != len(devices):
            raise E.ArenaError("a split arena needs distinct devices (open_devices makes several of one)")
        self._build(n_layers, n_kv_heads, head_dim, n_ctx, split, dict(enumerate(devices)), len(devices), arena_kw)

    def _build(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, split: str,
               devices: dict, n_parts: int, arena_kw: dict) -> None:
        """The parts ``devices`` (part index → Device) hold, of ``n_parts`` in all."""
        if split not in SPLITS:
            raise E.ArenaError(f"split must be one of {SPLITS}, got {split!r}")
        if arena_kw.get("seqs", 1) != 1:
            raise E.ArenaError("a split arena holds one sequence")
        self.split, self.n_layers, self.n_kv_heads, self.head_dim = split, n_layers, n_kv_heads, head_dim
        snap = runtime.snapshot()
        art = snap.artifact if C.resolve_cache(arena_kw.get("cache"), snap.active) == "dict" else None
        if art is not None and art.n_layers != n_layers:
            raise E.DictMismatchError(f"dictionary has {art.n_layers} layers, model {n_layers}")
        if art is not None and art.n_heads not in (1, n_kv_heads):
            raise E.DictMismatchError(f"the dictionary has {art.n_heads} heads per stream; the model has "
                                      f"{n_kv_heads} KV heads")
        self.cuts = part_cuts(split, n_layers, n_kv_heads, n_parts)  # every part's (layers, heads)
        self.parts: list[Part] = []  # the parts held here
        self._pool, self._steps = None, []  # record_step's steps, freed with the arena
        try:
            for index, dev in sorted(devices.items()):
                layers, heads = self.cuts[index]
                kw = dict(arena_kw)
                if art is not None:
                    kw.update(cache="dict", dictionary_part=artifact_part(art, layers, heads if split == "head"
                                                                          else None))
                arena = KvArena(layers[1] - layers[0], heads[1] - heads[0], head_dim, n_ctx, device=dev, **kw)
                self.parts.append(Part(arena, layers, heads))
        except BaseException:
            self.free()
            raise
        if len(self.parts) > 1:  # the parts held here driven at once (a thread a device: kp releases the GIL)
            self._pool = ThreadPoolExecutor(len(self.parts))

    # --- where things live ------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise E.LayerIndexError(f"layer {layer!r} outside 0..{self.n_layers - 1}")
        return int(layer)

    def _owner_index(self, layer: int) -> int:
        """The index of the part holding ``layer`` (a layer split's)."""
        i = self._layer(layer)
        return next(j for j, (ls, _) in enumerate(self.cuts) if ls[0] <= i < ls[1])

    def _at_owner(self, layer: int, call):
        """``call(arena, index there)`` on the part holding ``layer`` (a layer split's)."""
        part = self.parts[self._owner_index(layer)]
        return call(part.arena, layer - part.layers[0])

    def _concurrently(self, call, items) -> list:
        """``call(item)`` for each of ``items`` (at most one a device held here), at once, a
        thread each; in order."""
        if self._pool is None or len(items) < 2:
            return [call(x) for x in items]
        return list(self._pool.map(call, items))

    def _each(self, call) -> list:
        """``call(part)`` for every part, in the parts' order, at once."""
        return self._concurrently(call, self.parts)

    def _counts(self) -> np.ndarray:
        """Tokens each layer holds, in layer order (int64 (n_layers,))."""
        held = [p.arena.memory.counts(slice(None), 1)[:, 0] for p in self.parts]
        return held[0] if self.split == "head" else np.concatenate(held)

    def _combine(self, out: np.ndarray) -> np.ndarray:
        """A step's output with every part's heads written (here: all parts are local)."""
        return out

    def _advanced(self, layers) -> None:
        """A recorded step appended a token to each of ``layers`` (the parts count their own)."""

    def _gather_heads(self, outs: list) -> np.ndarray:
        """Every part's attention output of a layer, float32 (its query heads × head_dim) each
        in the parts' order (a head split's), joined: every head's."""
        return np.concatenate(outs)

    def _hand_on(self, stages, width: int) -> int:
        """A layer split's parts in layer order, each stage (a part's: x → its output) taking
        the output of the one before (float32 (width,); the first takes None); the last
        stage's result, an int."""
        x = None
        for stage in stages:
            x = stage(x)
        return int(x)

    def _rows(self, what: str, a, width: int | None = None) -> np.ndarray:
        """``a`` checked as (n_kv_heads, T, width) before any part sees it (a refusal changes nothing)."""
        w = self.head_dim if width is None else width
        if not isinstance(a, np.ndarray) or a.ndim != 3 or a.shape[0] != self.n_kv_heads or a.shape[2] != w:
            raise E.ShapeError(f"{what}: expected ({self.n_kv_heads}, T, {w}), got "
                               f"{getattr(a, 'shape', type(a).__name__)}")
        return a

    def _query(self, q) -> np.ndarray:
        if not isinstance(q, np.ndarray) or q.ndim != 2 or q.shape[1] != self.head_dim \
                or q.shape[0] < 1 or q.shape[0] % self.n_kv_heads:
            raise E.ShapeError(f"q: expected (n_heads, {self.head_dim}) with n_heads a multiple of "
                               f"{self.n_kv_heads}, got {getattr(q, 'shape', type(q).__name__)}")
        return q

    def _heads_of(self, part: Part, q: np.ndarray) -> np.ndarray:
        """The query heads reading ``part``'s KV heads (query head h reads KV head h // group)."""
        group = q.shape[0] // self.n_kv_heads
        return np.ascontiguousarray(q[part.heads[0] * group:part.heads[1] * group])

    def _check_room_all(self, layers) -> None:
        """ArenaError unless each of ``layers`` has room for one more token (every part's counts
        at once: no call a layer)."""
        counts, ctx = self._counts()[layers], self.parts[0].arena.seq_ctx
        if counts.max() >= ctx:
            j = int(counts.argmax())
            raise E.ArenaError(f"layer {layers[j]}: {counts[j]} + 1 tokens exceed n_ctx {ctx}")

    def _check_room(self, layer: int, n_new: int) -> None:
        n = self.n_tokens(layer)
        ctx = self.parts[0].arena.seq_ctx
        if n + n_new > ctx:
            raise E.ArenaError(f"layer {layer}: {n} + {n_new} tokens exceed n_ctx {ctx}")

    # --- KvArena's calls --------------------------------------------------------------------------
    def n_tokens(self, layer: int) -> int:
        if self.split == "layer":
            return self._at_owner(layer, lambda a, i: a.n_tokens(i))
        return self.parts[0].arena.n_tokens(self._layer(layer))

    def append(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray) -> int:
        """KvArena.append over the split: (n_kv_heads, T_new, head_dim) float32 each."""
        if self.split == "layer":
            return self._at_owner(layer, lambda a, i: a.append(i, k_rows, v_rows))
        layer = self._layer(layer)
        k, v = self._rows("k_rows", k_rows), self._rows("v_rows", v_rows)
        self._check_room(layer, k.shape[1])
        return self._each(lambda p: p.arena.append(layer, k[p.heads[0]:p.heads[1]], v[p.heads[0]:p.heads[1]]))[0]

    def append_codes(self, layer: int, k: np.ndarray, v: np.ndarray, rows=None) -> int:
        """KvArena.append_codes over the split (a coded stream's slots, a passthrough one's rows)."""
        if self.split == "layer":
            return self._at_owner(layer, lambda a, i: a.append_codes(i, k, v, rows=rows))
        layer = self._layer(layer)
        k, v = (self._rows(n, a, a.shape[2] if isinstance(a, np.ndarray) and a.ndim == 3 else None)
                for n, a in (("k", k), ("v", v)))
        self._check_room(layer, k.shape[1])

        def codes(p: Part):
            h = slice(*p.heads)
            return p.arena.append_codes(layer, k[h], v[h], rows=None if rows is None else (rows[0][h], rows[1][h]))
        return self._each(codes)[0]

    def read(self, layer: int, t0: int = 0, t1: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """KvArena.read over the split: (K, V) float32 (n_kv_heads, t1 − t0, head_dim)."""
        if self.split == "layer":
            return self._at_owner(layer, lambda a, i: a.read(i, t0, t1))
        layer = self._layer(layer)
        got = self._each(lambda p: p.arena.read(layer, t0, t1))
        return tuple(np.concatenate([g[j] for g in got], axis=0) for j in (0, 1))

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float | None = None) -> np.ndarray:
        """KvArena.attend over the split: (n_heads, head_dim) float32."""
        if self.split == "layer":
            return self._at_owner(layer, lambda a, i: a.attend(i, q, n_used, scale))
        layer, q = self._layer(layer), self._query(q)
        return np.concatenate(self._each(lambda p: p.arena.attend(layer, self._heads_of(p, q), n_used, scale)))

    def step(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray,
             scale: float | None = None) -> np.ndarray:
        """KvArena.step over the split: the new tokens appended, then attended over with q."""
        if self.split == "layer":
            return self._at_owner(layer, lambda a, i: a.step(i, k_rows, v_rows, q, scale))
        layer, q = self._layer(layer), self._query(q)
        k, v = self._rows("k_rows", k_rows), self._rows("v_rows", v_rows)
        self._check_room(layer, k.shape[1])
        h = lambda p: slice(*p.heads)  # noqa: E731
        return np.concatenate(self._each(
            lambda p: p.arena.step(layer, k[h(p)], v[h(p)], self._heads_of(p, q), scale)))

    def record_step(self, n_heads: int, layers=None, scale: float | None = None,
                    n_plan: int | None = None) -> "SplitStep":
        """KvArena.record_step over the split (one sequence): each device records its own step
        over what it holds of ``layers`` (default: every layer); ``run`` drives them at once."""
        self._query(np.zeros((n_heads, self.head_dim), np.float32))  # n_heads a multiple of n_kv_heads
        chosen = list(range(self.n_layers)) if layers is None else [self._layer(i) for i in layers]
        group = n_heads // self.n_kv_heads
        steps = []  # (part, positions in ``chosen`` it takes, its DecodeStep)
        for p in self.parts:
            mine = [j for j, i in enumerate(chosen) if p.layers[0] <= i < p.layers[1]]
            if mine:
                local = [chosen[j] - p.layers[0] for j in mine]
                steps.append((p, mine, p.arena.record_step(group * (p.heads[1] - p.heads[0]), local,
                                                           scale=scale, n_plan=n_plan)))
        step = SplitStep(self, steps, chosen, n_heads)
        self._steps.append(step)
        return step

    # --- what each device holds -------------------------------------------------------------------
    def memory(self) -> list[dict]:
        """Per device: its name, the layers and KV heads it holds, its arena's bytes and the
        part of them that is dictionaries (tails)."""
        return self._each(lambda p: dict(device=p.arena.device.name, layers=list(p.layers), kv_heads=list(p.heads),
                                         arena_bytes=p.arena.layout.total_bytes,
                                         tail_bytes=p.arena.layout.tail_bytes))

    def free(self) -> None:
        for step in getattr(self, "_steps", []):
            step.free()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown()
        for p in getattr(self, "parts", []):
            p.arena.free()

    def __enter__(self) -> "SplitArena":
        return self

    def __exit__(self, *exc) -> None:
        self.free()


class SplitStep:
    """A decode step of a SplitArena: each device's recorded step (KvArena.record_step) over its
    layers and KV heads, driven at once, a thread each; ``run`` takes and returns what one
    device's step does."""

    def __init__(self, arena: SplitArena, steps: list, layers: list, n_heads: int):
        self.arena, self._steps, self.layers, self.n_heads = arena, steps, layers, n_heads

    def run(self, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """k_rows / v_rows (n_layers, 1, n_kv_heads, head_dim), q (n_layers, 1, n_heads,
        head_dim) float32 → (n_layers, 1, n_heads, head_dim) float32, as DecodeStep.run; every
        check before any device runs."""
        a, hd, n_l = self.arena, self.arena.head_dim, len(self.layers)
        for what, x, heads in (("k_rows", k_rows, a.n_kv_heads), ("v_rows", v_rows, a.n_kv_heads),
                               ("q", q, self.n_heads)):
            if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (n_l, 1, heads, hd):
                raise E.ShapeError(f"SplitStep.run: {what} must be float32 {(n_l, 1, heads, hd)}, got "
                                   f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
        a._check_room_all(self.layers)
        group = self.n_heads // a.n_kv_heads

        def one(entry):
            p, mine, step = entry
            h, qh = slice(*p.heads), slice(p.heads[0] * group, p.heads[1] * group)
            return step.run(np.ascontiguousarray(k_rows[mine][:, :, h]), np.ascontiguousarray(v_rows[mine][:, :, h]),
                            np.ascontiguousarray(q[mine][:, :, qh]))
        outs = a._concurrently(one, self._steps)
        out = np.zeros((n_l, 1, self.n_heads, hd), np.float32)
        for (p, mine, _), o in zip(self._steps, outs):
            out[mine, :, p.heads[0] * group:p.heads[1] * group] = o
        a._advanced(self.layers)
        return a._combine(out)

    def free(self) -> None:
        for _, _, step in self._steps:
            step.free()
