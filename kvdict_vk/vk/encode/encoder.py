"""GPU OMP encoder: head vectors of one stream → slots (code words, then the residual stage),
computed on the device with the semantics of :func:`kvdict_vk.codec.encode`.

    enc = GpuEncoder(device, stream_dict)              # uploads the dictionary image once
    slots = enc.encode(x)                              # (n_kv, T, head_dim) f32 → (n_kv, T, slot_words) u32
    enc.encode_into(buf, x, region_word, n_ctx, t0)    # straight into any Buffer (a layer's):
        # word(h, t0 + i, j) = region_word + (h·n_ctx + t0 + i)·slot_words + j
    enc.free()

Two forms of the same computation, ``kernel=``:

* ``"tiled"`` (the default on GPUs): a batch is one dispatch. Of omp_encode_tiled, where a
  workgroup runs every OMP step and the residual stage of a tile of vectors, the
  correlations as a matrix product against atom tiles in shared memory
  (kvdict_vk/vk/encode_tiled.py chooses tile sizes and launch shapes); or, for batches of
  at most ``vector_per_head`` vectors per dictionary head (a decode step's), of
  omp_encode_vector: a workgroup per vector, all of its work spread over the workgroup
  (kvdict_vk/vk/encode_vector.py says why).
* ``"stepwise"`` (the default on CPU drivers): per batch pick phase 0 (r = x − mean), the
  metric kernel (metric streams), then per OMP step the correlation kernel (one workgroup
  per 64 tokens of a head × ATOM_BLOCK atoms; every lane reads the same atoms) and the pick
  kernel (one invocation per vector); the last pick writes the slots. Why two kernels per
  step and not one loop per vector on llvmpipe: shaders/encode_common.glsl.

Inputs are checked here (ShapeError), every dispatch by kernels.Kernel (DispatchError).
Not thread-safe: one encoder belongs to one thread at a time.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ... import errors as E
from ...dictionary import StreamDict
from . import image as I
from ..device import Device, get_device, kp
from .specs import n_blocks
from .tiled import VECTOR_FORM, TiledKernels, tile_for
from .tiled import max_batch as max_tiled_batch
from .vector import MAX_PER_HEAD
from ..kernels import Buffer, Kernel, barrier, pipeline, release, run

TILE = 64  # tokens per workgroup (the shaders' WG_SIZE)
# Workgroups per correlation/metric dispatch: a kp pipeline has a fixed count, and those two
# kernels must not branch (no early exit for surplus workgroups), so a run of n tiles is
# dispatched greedily as 16s, 4s and 1s — exact, at most 6 small dispatches more.
DISPATCH_WIDTHS = (16, 4, 1)
WORK_BUFFER_WORDS = 1 << 23  # each work buffer ≤ 32 MiB (sets the batch capacity)
MAX_INPUT = 1e16  # |x| beyond this could overflow float32 sums of squares
_MAX_DEST_KERNELS = 8  # destination buffers with a cached pick pipeline
TILED_MAX_BATCH = 1 << 16  # vectors per tiled submission (input and output buffers only)
KERNELS = ("auto", "tiled", "stepwise")


def kernel_for(kernel: str, device: Device) -> str:
    """"tiled" or "stepwise": ``auto`` is the stepwise form on CPU drivers (llvmpipe runs
    only straight-line loads well, and caps loop iterations), the tiled one elsewhere."""
    if kernel not in KERNELS:
        raise E.ShapeError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        return "stepwise" if device.is_cpu else "tiled"
    return kernel


class GpuEncoder:
    """OMP-encode one stream's head vectors on a Vulkan device (see the module docstring).

    Metric dictionaries are supported (OMP in the metric's space, as codec.omp). On
    llvmpipe a configuration whose pick kernel would exceed the driver's loop-iteration cap
    (sparsity ≳ 240) is refused with DispatchError."""

    def __init__(self, device: "int | str | Device | None", stream: StreamDict, *, max_batch: int | None = None,
                 kernel: str = "auto", vector_per_head: int | None = None):
        """``max_batch``: at most this many vectors per submission (rounded up to a tile),
        which bounds the work buffers — an arena keeps one encoder per coded stream and
        decodes a few vectors per step, so it asks for small batches. ``kernel``: "tiled",
        "stepwise" or "auto" (:func:`kernel_for`). ``vector_per_head`` (the tiled form): batches of
        at most this many vectors per dictionary head run the vector kernel (default
        encode_vector.MAX_PER_HEAD, measured; 0: never)."""
        if not isinstance(stream, StreamDict):
            raise E.ShapeError(f"GpuEncoder needs a StreamDict, got {type(stream).__name__}")
        self.device, self.stream = get_device(device), stream
        self.kernel = kernel_for(kernel, self.device)
        if vector_per_head is None:
            vector_per_head = MAX_PER_HEAD
        if isinstance(vector_per_head, bool) or not isinstance(vector_per_head, int) or vector_per_head < 0:
            raise E.ShapeError(f"vector_per_head must be a non-negative integer, got {vector_per_head!r}")
        self.vector_per_head = vector_per_head
        tiled = self.kernel == "tiled"
        d = stream
        self.head_dim, self.n_atoms, self.slot_words = d.head_dim, d.n_atoms, d.slot_words
        self.atom_block = I.atom_block(d.head_dim, d.n_atoms)
        loops = I.pick_loop_iterations(d.head_dim, d.sparsity, d.n_atoms, self.atom_block, d.residual_bits)
        if not tiled and loops > I.LOOP_BUDGET and I.caps_loops(self.device):
            raise E.DispatchError(f"{self.device.name}: sparsity {d.sparsity} needs ~{loops} loop iterations "
                                  f"per vector and step; llvmpipe stops loops at {I.LOOP_ITERATION_CAP}")
        lim = self.device.info.limits
        max_words = min(lim["max_storage_buffer_range"], lim["max_memory_allocation_size"] or 1 << 62) // 4
        image = I.dictionary_image(d, self.atom_block, transposed=tiled)
        if image.words.size > max_words:
            raise E.ArenaTooLargeError(f"{self.device.name}: the dictionary image needs {4 * image.words.size} "
                                       f"bytes, one binding holds at most {4 * max_words}")
        cap_words = min(WORK_BUFFER_WORDS, max_words)
        if tiled:
            wanted = min(TILED_MAX_BATCH, cap_words // max(d.head_dim, d.slot_words))
            self.capacity = max(TILE, max_tiled_batch(self.device, d, wanted) // TILE * TILE)
        else:
            self.capacity = I.batch_capacity(d, self.atom_block, cap_words, TILE)
        if max_batch is not None:
            if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
                raise E.ShapeError(f"max_batch must be a positive integer, got {max_batch!r}")
            self.capacity = min(self.capacity, -(-max_batch // TILE) * TILE)
        sizes = {"out": self.capacity * d.slot_words} if tiled else I.state_sizes(d, self.atom_block, self.capacity)
        if max(sizes.values()) > max_words:
            raise E.ArenaTooLargeError(f"{self.device.name}: one batch of {TILE} vectors needs "
                                       f"{4 * max(sizes.values())} bytes in one binding")
        self.lanes = 4 if d.head_dim % 4 == 0 else 1  # floats an input element holds (the _vec4 builds)
        lanes = "vec4" if self.lanes == 4 else "scalar"
        self.metric_rows = I.metric_rows(d.head_dim, self.lanes)
        residual = "_residual" if d.residual_bits else ""
        self._variants = {"corr": f"omp_encode_corr_{lanes}", "metric": f"omp_encode_metric_{lanes}",
                          "pick": f"omp_encode_pick{residual}_{lanes}", "tiled": f"omp_encode_tiled{residual}_{lanes}",
                          "vector": f"omp_encode_vector{residual}_{lanes}"}
        self._spec = {"DIM": d.head_dim, "SPARSITY": d.sparsity, "ATOM_BLOCK": self.atom_block}
        if d.residual_bits:
            self._spec.update(RESIDUAL_BITS=d.residual_bits, N_STEPS=image.n_steps)
        self._push = dict(image.offsets, n_atoms=d.n_atoms, per_head=int(d.n_heads > 1), atoms_pad=image.atoms_pad,
                          res_word=0, basis_word=self.capacity * d.head_dim)
        self._buffers: dict[str, Buffer] = {}
        self._kernels: dict = {}
        self._tiled: TiledKernels | None = None
        self._freed = False
        try:
            self._buffers["dict"] = self._upload(image.words)
            self._buffers["x"] = Buffer(self.device, self.capacity * d.head_dim, "host", "encoder input")
            for name, words in sizes.items():
                kind = "device" if name == "out" else "storage"
                self._buffers[name] = Buffer(self.device, words, kind, f"encoder {name}")
            b = self._buffers
            if tiled:
                self._tiled = TiledKernels(self.device, d, (self._variants["tiled"], self._variants["vector"]),
                                           b["dict"], b["x"], self.capacity, image.n_steps, vector_per_head)
            for w in DISPATCH_WIDTHS if not tiled else ():
                self._kernels[("corr", w)] = pipeline(self.device, self._variants["corr"],
                                                    [b["dict"], b["state_elems"], b["keys"]],
                                                    {"DIM": d.head_dim, "ATOM_BLOCK": self.atom_block},
                                                    max_items=w)
                if d.metric is not None:
                    self._kernels[("metric", w)] = pipeline(self.device, self._variants["metric"],
                                                          [b["dict"], b["state_elems"]],
                                                          {"DIM": d.head_dim, "METRIC_ROWS": self.metric_rows},
                                                          max_items=w)
        except BaseException:
            self.free()
            raise

    # --- setup ----------------------------------------------------------------------------------
    def _upload(self, words: np.ndarray) -> Buffer:
        """The image into a device-local buffer through a host-visible staging buffer."""
        dst = Buffer(self.device, words.size, "storage", "encoder dictionary image")
        step = min(words.size, 1 << 20)
        staging = Buffer(self.device, step, "host", "encoder dictionary staging")
        copy = None
        try:
            copy = pipeline(self.device, "copy_vec4", [staging, dst], max_items=step // 4)
            for start in range(0, words.size, step):
                part = words[start:start + step]
                staging.host_words()[:part.size] = part
                run(self.device, copy.op(src_word=0, dst_word=start, n_words=part.size),
                    what="uploading the encoder's dictionary image")
        except BaseException:
            dst.destroy()
            raise
        finally:
            if copy is not None:
                release(copy)
            staging.destroy()
        return dst

    def _pick_kernel(self, dest: Buffer) -> Kernel:
        """The pick kernel writing into ``dest`` (a pipeline binds its buffers: one per dest)."""
        key = ("pick", id(dest))
        kern = self._kernels.get(key)
        if kern is not None and kern.buffers[-1] is dest:
            return kern
        if kern is not None:  # a freed buffer's id was reused
            release(self._kernels.pop(key))
        picks = [k for k in self._kernels if k[0] == "pick"]
        if len(picks) >= _MAX_DEST_KERNELS:
            release(self._kernels.pop(picks[0]))
        b = self._buffers
        self._kernels[key] = pipeline(self.device, self._variants["pick"],
                                    [b["x"], b["dict"], b["dict"], b["state_elems"], b["state_words"],
                                     b["keys"], dest], self._spec, max_items=self.capacity // TILE)
        return self._kernels[key]

    # --- checks ---------------------------------------------------------------------------------
    def _live(self) -> None:
        if self._freed:
            raise E.ArenaError("the encoder was freed")

    def _check_x(self, x) -> np.ndarray:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise E.ShapeError(f"x: expected a float32 numpy array, got {getattr(x, 'dtype', type(x).__name__)}")
        heads = self.stream.n_heads
        if x.ndim != 3 or x.shape[2] != self.head_dim or x.shape[0] < 1 or (heads > 1 and x.shape[0] != heads):
            raise E.ShapeError(f"x: shape {x.shape}, expected ({heads if heads > 1 else 'n_kv'}, T, {self.head_dim})")
        if x.shape[0] > self.capacity:
            raise E.ShapeError(f"x: {x.shape[0]} KV heads exceed a batch of {self.capacity} vectors")
        if x.size and not (np.isfinite(x).all() and np.abs(x).max() <= MAX_INPUT):
            raise E.ShapeError(f"x holds NaN, Inf or magnitudes beyond {MAX_INPUT:g}")
        return np.ascontiguousarray(x)

    @staticmethod
    def _index(name: str, v) -> int:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise E.DispatchError(f"{name} must be a non-negative integer, got {v!r}")
        return int(v)

    # --- encoding ---------------------------------------------------------------------------------
    def _batches(self, n_kv: int, n_tok: int) -> list:
        per = self.capacity // n_kv
        return [(c0, min(n_tok, c0 + per)) for c0 in range(0, n_tok, per)]

    def _runs(self, kind: str, first: int, count: int, **push) -> list:
        """Dispatches of ``kind`` covering workgroups first .. first+count−1 exactly."""
        ops = []
        for w in DISPATCH_WIDTHS:
            while count >= w:
                ops.append(self._kernels[(kind, w)].op(**dict(push, group0=first)))
                first, count = first + w, count - w
        return ops

    def _batch_ops(self, dest: Buffer, x_part: np.ndarray, region_word: int, n_ctx: int, t0: int) -> list:
        """Stage one batch and return its checked dispatches, in order."""
        n_kv, n_tok, _ = x_part.shape
        n = n_kv * n_tok
        self._buffers["x"].host_words()[:x_part.size] = x_part.reshape(-1).view(np.uint32)
        push = dict(self._push, phase=0, step=0, group0=0, block=0, dict_head=0, n_tok=n_tok,
                    n_vectors=n, dst_word=region_word, n_ctx=n_ctx, t0=t0)
        if self._tiled is not None:  # one dispatch: every step of every tile
            return [self._tiled_op(dest, push)]
        pick = self._pick_kernel(dest)
        b = self._buffers
        state = barrier(b["state_elems"], b["state_words"])  # pick → metric / corr / pick
        if self.stream.metric is None:
            ops = [pick.op(**push), state]
        else:  # x − mean into the (still unused) basis area, then r = W(x − mean) by row blocks
            ops = [pick.op(**dict(push, res_word=self._push["basis_word"])), state]
            for block in range(-(-self.head_dim // self.metric_rows)):
                ops += self._runs("metric", 0, -(-n // TILE), **dict(push, block=block))
            ops.append(barrier(b["state_elems"]))
        # The atom address of a correlation dispatch may depend on push constants only (see
        # omp_encode_corr.comp): one run of dispatches per (dictionary head, atom block).
        # They write disjoint parts of the keys buffer, so they need no barrier between them.
        tiles = -(-n_tok // TILE)
        heads = [(h, h * tiles, tiles) for h in range(n_kv)] if self.stream.n_heads > 1 else [(0, 0, n_kv * tiles)]
        for k in range(self.stream.sparsity):
            for block in range(n_blocks(self.n_atoms, self.atom_block)):
                for h, first, count in heads:
                    ops += self._runs("corr", first, count, **dict(push, step=k, block=block, dict_head=h))
            ops += [barrier(b["keys"]), pick.op(**dict(push, phase=1, step=k)), state]
        return ops

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Head vectors (n_kv, T, head_dim) float32 → slots (n_kv, T, slot_words) uint32."""
        self._live()
        x = self._check_x(x)
        n_kv, n_tok, _ = x.shape
        out = np.empty((n_kv, n_tok, self.slot_words), np.uint32)
        dest = self._buffers["out"]
        for c0, c1 in self._batches(n_kv, n_tok):
            tc = c1 - c0
            ops = self._batch_ops(dest, x[:, c0:c1], 0, tc, 0)
            run(self.device, *ops, kp.OpTensorSyncLocal([dest.tensor]), what="GPU OMP encode")
            out[:, c0:c1] = dest.host_words()[:n_kv * tc * self.slot_words].reshape(n_kv, tc, -1)
        return out

    def ops_into(self, dest: Buffer, x: np.ndarray, region_word: int, n_ctx: int, t0: int) -> list:
        """The checked dispatches of encode_into for one batch (x at most ``capacity``
        vectors), to record and time (bench.encode): they read x from the encoder's input
        buffer as staged now. The tiled form is one op; the stepwise form ~3 per OMP step."""
        self._live()
        x = self._check_x(x)
        n_kv, n_tok, _ = x.shape
        if not self.one_batch(n_kv, n_tok):
            raise E.ShapeError(f"ops_into: {n_kv}×{n_tok} vectors, one batch holds 1..{self.capacity}")
        self._check_dest(dest, n_kv, n_tok, region_word, n_ctx, t0)
        return self._batch_ops(dest, x, region_word, n_ctx, t0)

    def _tiled_op(self, dest: Buffer, push: dict, x: Buffer | None = None):
        """The tiled form's one dispatch for ``push``'s batch (its tile size from the vectors a
        dictionary head takes), reading x (None: the encoder's input buffer)."""
        per_group = push["n_tok"] if self.stream.n_heads > 1 else push["n_vectors"]
        return self._tiled.kernel(tile_for(per_group, self.vector_per_head), dest, _MAX_DEST_KERNELS, x).op(**push)

    def recorded_op(self, x: Buffer, x_word: int, dest: Buffer, region_word: int, n_kv: int):
        """The op that encodes one vector per KV head read on the device — head h's at
        x_word + h·head_dim of ``x`` — into its slot at region_word + h·slot_words of ``dest``:
        for a recording replayed per token (a decode step's rows made by earlier kernels of
        the same submission). The tiled form only (one dispatch: its vector kernel)."""
        self._live()
        if self._tiled is None:
            raise E.DispatchError(f"recorded_op: the {self.kernel} encoder records several dispatches a step; "
                                  f"make the encoder with kernel='tiled'")
        for what, buf in (("x", x), ("dest", dest)):
            if not isinstance(buf, Buffer) or not buf.alive or any(buf is b for b in self._buffers.values()):
                raise E.DispatchError(f"recorded_op: {what} must be a live Buffer of the caller's, got {buf!r}")
        x_word, n_kv = self._index("x_word", x_word), self._index("n_kv", n_kv)
        if x_word % self.lanes or x_word + n_kv * self.head_dim > x.words or not 1 <= n_kv <= self.capacity:
            raise E.DispatchError(f"recorded_op: {n_kv} vectors from word {x_word} (a multiple of {self.lanes}) "
                                  f"of {x.name} ({x.words} words), at most {self.capacity}")
        region_word, _, _ = self._check_dest(dest, n_kv, 1, region_word, 1, 0)
        return self._tiled_op(dest, dict(self._push, phase=0, step=0, group0=0, block=0, dict_head=0, n_tok=1,
                                         n_vectors=n_kv, dst_word=region_word, n_ctx=1, t0=0, x_word=x_word), x)

    def one_batch(self, n_kv: int, n_tok: int) -> bool:
        """Whether n_kv × n_tok vectors (n_tok ≥ 1) are one batch: what ops_into takes."""
        return n_tok >= 1 and n_kv * n_tok <= self.capacity

    def _check_dest(self, dest, n_kv: int, n_tok: int, region_word, n_ctx, t0) -> tuple:
        if not isinstance(dest, Buffer) or not dest.alive:
            raise E.DispatchError(f"encode_into: dest must be a live Buffer, got {dest!r}")
        if any(dest is b for b in self._buffers.values()):
            raise E.DispatchError("encode_into: dest is one of the encoder's own buffers")
        region_word, n_ctx, t0 = (self._index(n, v) for n, v in
                                  (("region_word", region_word), ("n_ctx", n_ctx), ("t0", t0)))
        if t0 + n_tok > n_ctx:
            raise E.DispatchError(f"encode_into: tokens [{t0}, {t0 + n_tok}) exceed n_ctx {n_ctx}")
        end = region_word + ((n_kv - 1) * n_ctx + t0 + n_tok) * self.slot_words
        if n_tok and end > dest.words:
            raise E.DispatchError(f"encode_into: the slots end at word {end}, {dest.name} has {dest.words}")
        return region_word, n_ctx, t0

    def encode_into(self, dest: Buffer, x: np.ndarray, region_word: int, n_ctx: int, t0: int) -> None:
        """Encode x (n_kv, T, head_dim) float32 into ``dest``: slot word j of token i of head h
        at region_word + (h·n_ctx + t0 + i)·slot_words + j; no other word of ``dest`` is
        written. DispatchError when t0 + T > n_ctx or the slots would leave the buffer."""
        self._live()
        if not isinstance(dest, Buffer) or not dest.alive:  # before x: the tests' order of errors
            raise E.DispatchError(f"encode_into: dest must be a live Buffer, got {dest!r}")
        x = self._check_x(x)
        n_kv, n_tok, _ = x.shape
        region_word, n_ctx, t0 = self._check_dest(dest, n_kv, n_tok, region_word, n_ctx, t0)
        for c0, c1 in self._batches(n_kv, n_tok):
            ops = self._batch_ops(dest, x[:, c0:c1], region_word, n_ctx, t0 + c0)
            run(self.device, *ops, what="GPU OMP encode")

    def launch_shapes(self) -> dict:
        """The one-dispatch pipelines made so far, for reports: {tile size: {"form", the
        shape's fields, "workgroups"}} (tile size 1: the vector form); {} for the stepwise form."""
        if self._tiled is None:
            return {}
        return {str(tv): {"form": "vector" if tv == VECTOR_FORM else "tiled", **dataclasses.asdict(shape),
                          "workgroups": wg} for tv, (shape, wg) in self._tiled.shapes().items()}

    # --- lifetime -----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._freed

    def free(self) -> None:
        """Release the pipelines and buffers. Idempotent; later use raises ArenaError."""
        if self._freed:
            return
        self._freed = True
        if self._tiled is not None:
            self._tiled.destroy()
        for k in self._kernels.values():
            release(k)
        for b in self._buffers.values():
            b.destroy()
        self._kernels.clear()
        self._buffers.clear()

    def __enter__(self) -> "GpuEncoder":
        self._live()
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        s = self.stream
        state = "freed" if self._freed else f"batch {self.capacity}"
        return (f"GpuEncoder({self.kernel}, heads={s.n_heads}, n_atoms={s.n_atoms}, head_dim={s.head_dim}, s={s.sparsity}, "
                f"residual_bits={s.residual_bits}, metric={s.metric is not None}, atom_block={self.atom_block}, "
                f"{state}, {self.device.name})")
