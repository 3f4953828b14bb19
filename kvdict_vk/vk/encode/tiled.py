"""The tiled form of the GPU OMP encoder (shaders/omp_encode_tiled.comp): its launch shapes
and pipelines, owned by :class:`kvdict_vk.vk.encode.encoder.GpuEncoder`.

A batch is one dispatch: a workgroup runs every OMP step (and the residual stage) of a tile
of ``TILE_VECTORS`` vectors of one dictionary head, the correlations as a matrix product
against atom tiles staged in shared memory. The tile size follows the batch: a tile costs
about the same whatever number of its lanes are live (the product runs all of them), so
a decode step's few vectors per dictionary head take the smallest tile and a prompt the
largest. Per tile size, the workgroup size and the staged dimensions per atom tile are
chosen from the device's limits (shared memory, workgroup size), so no optional feature
is needed; the work state is a region per workgroup (not per vector), so a batch can hold
as many vectors as the input and output buffers do.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import errors as E
from . import vector as V
from .image import LOOP_BUDGET, LOOP_ITERATION_CAP, caps_loops, step_multipliers
from .specs import state_words
from ..kernels import Buffer, Kernel, pipeline, release

# Vectors per workgroup, largest first (each a multiple of 4): a batch asks for the largest
# and tile_shape falls back to the next where it does not fit the device's shared memory (a
# residual stage's 64-vector tile needs more than 48 KiB: it runs 16-vector tiles); the
# smallest also takes the vector form's batches where that form does not fit.
TILE_SIZES = (64, 16, 4)
LOCALS = (256, 128, 64)  # workgroup sizes tried, largest first
MAX_CHUNK_DIMS = 64
SHARED_BUDGET = 48 * 1024  # bytes: at most this much of the device's shared memory per workgroup
MAX_WORKGROUPS = 1024
STATE_WORDS_CAP = 1 << 23  # each work-state buffer ≤ 32 MiB (bounds the workgroups)


@dataclass(frozen=True)
class TileShape:
    tile_vectors: int
    local: int
    chunk_dims: int

    @property
    def atom_tile(self) -> int:
        return 4 * self.local // (self.tile_vectors // 4)


def shared_bytes(head_dim: int, sparsity: int, shape: TileShape, n_steps: int) -> int:
    """Shared memory of one workgroup (the shader's shared arrays; n_steps 0: no residual stage)."""
    tv, vgroups = shape.tile_vectors, shape.tile_vectors // 4
    agroups = shape.local // vgroups
    # the residual stage's code words, u, spread and candidates
    residual = 4 * tv * sparsity + 8 * head_dim * tv + 16 * tv + 12 * tv * n_steps if n_steps else 0
    return 16 * (head_dim * vgroups + max(1, shape.chunk_dims * agroups)) + 8 * tv * agroups + residual


def tile_shape(device, head_dim: int, sparsity: int, tile_vectors: int, n_steps: int) -> TileShape:
    """The launch shape for tiles of ``tile_vectors`` (or fewer, where they do not fit): the
    largest workgroup, then the deepest atom tile, that fit the device's limits. Tiles of
    4 vectors (one vector group: the decode step's) stage no atoms (chunk_dims 0): each
    atom element is used by one invocation only, so they read the image directly."""
    max_local = min(device.limit("max_compute_work_group_invocations"),
                    device.limit("max_compute_work_group_size")[0])
    budget = min(SHARED_BUDGET, device.limit("max_compute_shared_memory_size"))
    divisors = [c for c in range(min(head_dim, MAX_CHUNK_DIMS), 0, -1) if head_dim % c == 0]
    for tv in (t for t in TILE_SIZES if t <= tile_vectors):
        for local in LOCALS:
            if local > max_local or local % (tv // 4):
                continue
            for chunk in divisors if tv > 4 else [0]:
                shape = TileShape(tv, local, chunk)
                if shared_bytes(head_dim, sparsity, shape, n_steps) <= budget:
                    return shape
    raise E.DispatchError(f"{device.name}: no tiled encoder shape for head_dim {head_dim} fits "
                          f"{budget} bytes of shared memory")


VECTOR_FORM = 1  # the "tile size" that asks for the vector form (omp_encode_vector: a vector per workgroup)


def tile_for(per_group: int, vector_per_head: int = V.MAX_PER_HEAD) -> int:
    """Tile size for a batch with ``per_group`` vectors per dictionary head: VECTOR_FORM for
    at most ``vector_per_head`` (a decode step's few), else the largest tile."""
    return VECTOR_FORM if per_group <= vector_per_head else TILE_SIZES[0]


def loop_iterations(head_dim: int, s: int, n_atoms: int, shape: TileShape, residual_bits: int,
                    n_steps: int, metric: bool, items_per_workgroup: int) -> int:
    """An upper bound of one invocation's loop iterations (llvmpipe's cap), counting every
    loop as if none were unrolled."""
    d, tv, at = head_dim, shape.tile_vectors, shape.atom_tile
    tiles = -(-n_atoms // at)
    init = -(-d * tv // shape.local) + (2 * d + d * d if metric else 0)
    if shape.chunk_dims:
        chunks = d // shape.chunk_dims
        product = tiles * chunks * (-(-shape.chunk_dims * at // shape.local) + shape.chunk_dims)
    else:
        product = tiles * d * 4
    step = product + tiles * 16 \
        + 24 + 2 * s + s * s + 2 * s * 2 * d + 4 * d  # the tree over the atom groups: ≤ log2 + 4 per level sum
    finish = s * s + 2 * s
    res = 0
    if residual_bits:
        elements, pairs = -(-tv * d // shape.local), -(-tv * n_steps // shape.local)
        res = elements * 2 * s + 2 * d + pairs * (2 * d) + n_steps + 2 * d + -(-d * residual_bits // 32)
    return items_per_workgroup * (init + s * step + finish + res)


def max_batch(device, stream, wanted: int) -> int:
    """Vectors per batch, at most ``wanted``: on llvmpipe no more than the largest tile's
    workgroups cover in one pass (each workgroup one tile, so its loops stay under the cap)."""
    if not caps_loops(device):
        return wanted
    n_steps = len(step_multipliers(stream.residual_bits)) if stream.residual_bits else 0
    tv = tile_shape(device, stream.head_dim, stream.sparsity, TILE_SIZES[0], n_steps).tile_vectors
    return max(tv, min(wanted, (workgroup_cap(device, stream, tv) - stream.n_heads) * tv))


def state_per_workgroup(stream, tile_vectors: int) -> tuple:
    """Words of one workgroup's work state: (bases, bookkeeping words)."""
    return stream.sparsity * stream.head_dim * tile_vectors, state_words(stream.sparsity) * tile_vectors


def workgroup_cap(device, stream, tile_vectors: int) -> int:
    """The most workgroups a tiled pipeline takes: MAX_WORKGROUPS, within the state buffers'
    cap and the device's limit."""
    return max(1, min(MAX_WORKGROUPS, STATE_WORDS_CAP // max(state_per_workgroup(stream, tile_vectors)),
                      device.limit("max_compute_work_group_count")[0]))


class TiledKernels:
    """The one-dispatch pipelines of one encoder: per (tile size, destination buffer) the
    tiled kernel with its work state sized for its workgroup count, or for VECTOR_FORM the
    vector kernel (no work state: it lives in shared memory). Without a vector shape that
    fits the device (or llvmpipe's loop cap), VECTOR_FORM batches take the smallest tile."""

    def __init__(self, device, stream, variants: tuple, dict_buffer: Buffer, x_buffer: Buffer, capacity: int,
                 n_steps: int, vector_per_head: int = V.MAX_PER_HEAD):
        """``variants``: the SPIR-V names of the (tiled, vector) kernels; batches of at most
        ``vector_per_head`` vectors per dictionary head take the vector form (tile_for)."""
        self.device, self.stream, (self.variant, self.vector_variant) = device, stream, variants
        self.vector_per_head = vector_per_head
        self.dict_buffer, self.x_buffer, self.capacity, self.n_steps = dict_buffer, x_buffer, capacity, n_steps
        self._state: dict[int, tuple] = {}  # tile size → (shape, basis buffer, words buffer, workgroups)
        self._kernels: dict[tuple, Kernel] = {}
        # (n_steps is the image's: 0 without a residual stage)
        self.vector = V.vector_shape(device, stream.head_dim, stream.sparsity, n_steps)
        vector_items = -(-self._vector_batch() // self._vector_workgroups())  # vectors per workgroup
        if self.vector is not None and caps_loops(device) and V.loop_iterations(
                stream.head_dim, stream.sparsity, stream.n_atoms, self.vector, stream.residual_bits, n_steps,
                stream.metric is not None, vector_items) > LOOP_BUDGET:
            self.vector = None
        if caps_loops(device):  # refused up front, before anything is allocated
            # (the small tile only where it stands in for the vector form)
            for tv in TILE_SIZES if self.vector is None else TILE_SIZES[:1]:
                shape, workgroups = self._launch(tv)
                loops = loop_iterations(stream.head_dim, stream.sparsity, stream.n_atoms, shape,
                                        stream.residual_bits, n_steps, stream.metric is not None,
                                        -(-self._tiles(tv, shape.tile_vectors) // workgroups))
                if loops > LOOP_BUDGET:
                    raise E.DispatchError(f"{device.name}: the tiled encoder needs ~{loops} loop iterations per "
                                          f"invocation; llvmpipe stops loops at {LOOP_ITERATION_CAP}")

    def spec(self, shape: TileShape) -> dict:
        d = self.stream
        spec = {"DIM": d.head_dim, "SPARSITY": d.sparsity, "TILE_VECTORS": shape.tile_vectors,
                "LOCAL": shape.local, "CHUNK_DIMS": shape.chunk_dims, "METRIC": int(d.metric is not None)}
        if d.residual_bits:
            spec.update(RESIDUAL_BITS=d.residual_bits, N_STEPS=self.n_steps)
        return spec

    def _tiles(self, tile_vectors: int, actual: int) -> int:
        """The most tiles (of ``actual`` vectors) a batch dispatches for this tile size: a
        full batch at the largest (a partial tile per dictionary head besides); the small
        tile takes only VECTOR_FORM batches (at most vector_per_head per dictionary head)."""
        if tile_vectors == TILE_SIZES[0]:
            return -(-self.capacity // actual) + self.stream.n_heads
        return self.stream.n_heads * -(-max(1, self.vector_per_head) // actual)

    def _launch(self, tile_vectors: int) -> tuple:
        """(TileShape, workgroups) for this tile size: every tile of a full batch at once,
        within the state buffers' cap and the device's limit."""
        d = self.stream
        shape = tile_shape(self.device, d.head_dim, d.sparsity, tile_vectors, self.n_steps)
        workgroups = min(self._tiles(tile_vectors, shape.tile_vectors),
                         workgroup_cap(self.device, d, shape.tile_vectors))
        return shape, max(1, workgroups)

    def _vector_batch(self) -> int:
        """The most vectors of a batch the vector form takes."""
        return max(1, min(self.vector_per_head * self.stream.n_heads, self.capacity))

    def _vector_workgroups(self) -> int:
        """A workgroup per vector of the largest batch the vector form takes, within the
        device's limit."""
        return min(self._vector_batch(), self.device.limit("max_compute_work_group_count")[0])

    def _state_for(self, tile_vectors: int):
        if tile_vectors in self._state:
            return self._state[tile_vectors]
        if tile_vectors == VECTOR_FORM:
            self._state[tile_vectors] = (self.vector, None, None, self._vector_workgroups())
            return self._state[tile_vectors]
        shape, workgroups = self._launch(tile_vectors)
        basis_per, words_per = state_per_workgroup(self.stream, shape.tile_vectors)
        basis = Buffer(self.device, workgroups * basis_per, "storage", f"tiled encoder bases ({tile_vectors})")
        try:
            words = Buffer(self.device, workgroups * words_per, "storage", f"tiled encoder state ({tile_vectors})")
        except BaseException:
            basis.destroy()
            raise
        self._state[tile_vectors] = (shape, basis, words, workgroups)
        return self._state[tile_vectors]

    def kernel(self, tile_vectors: int, dest: Buffer, max_dests: int, x: Buffer | None = None) -> Kernel:
        """The pipeline for this tile size reading its vectors from ``x`` (None: the encoder's
        input buffer) and writing into ``dest`` (made on first use; at most ``max_dests``
        destinations are kept per tile size)."""
        if tile_vectors == VECTOR_FORM and self.vector is None:  # the smallest tile stands in
            tile_vectors = TILE_SIZES[-1]
        shape, basis, words, workgroups = self._state_for(tile_vectors)
        x = self.x_buffer if x is None else x
        key = (tile_vectors, id(dest), id(x))
        kern = self._kernels.get(key)
        if kern is not None and kern.buffers[-1] is dest and kern.buffers[0] is x:
            return kern
        if kern is not None:  # a freed buffer's id was reused
            release(self._kernels.pop(key))
        same = [k for k in self._kernels if k[0] == tile_vectors]
        if len(same) >= max_dests:
            release(self._kernels.pop(same[0]))
        b = self.dict_buffer
        if tile_vectors == VECTOR_FORM:
            kern = pipeline(self.device, self.vector_variant, [x, b, b, dest],
                          V.spec(self.stream, shape, self.n_steps), max_items=workgroups * shape.local)
        else:
            kern = pipeline(self.device, self.variant, [x, b, b, basis, words, dest], self.spec(shape),
                          max_items=workgroups * shape.local)
        if kern.workgroups > workgroups:  # the state holds a region per workgroup
            release(kern)
            raise E.DispatchError(f"{self.variant}: {kern.workgroups} workgroups, state for {workgroups}")
        self._kernels[key] = kern
        return kern

    def shapes(self) -> dict:
        """Tile size → (TileShape or VectorShape, workgroups), for reports."""
        return {tv: (st[0], st[3]) for tv, st in self._state.items()}

    def destroy(self) -> None:
        for k in self._kernels.values():
            release(k)
        for _, basis, words, _ in self._state.values():
            for buf in (basis, words):
                if buf is not None:
                    buf.destroy()
        self._kernels.clear()
        self._state.clear()
