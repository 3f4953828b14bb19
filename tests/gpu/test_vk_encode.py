"""GPU OMP encoder (kvdict_vk.vk.encode.encoder) against the NumPy reference (codec.encode).

Every test that takes the ``encoder`` fixture runs for each form of the encoder: the
one-dispatch kernels (kernel="tiled", the default on GPUs: omp_encode_tiled, and
omp_encode_vector for batches of few vectors per dictionary head), the vector kernel for
every batch ("vector": kernel="tiled" with vector_per_head raised, so each test's inputs
reach it), and the stepwise kernels (the default on CPU drivers). Dictionaries too
large for the tiled kernel under llvmpipe's loop cap run with kernel="auto"
(test_large_dictionaries): stepwise on lavapipe, tiled on a GPU.

* Well-conditioned inputs (random unit atoms, Gaussian vectors): the GPU picks the same atom
  set as codec.omp for every vector in these cases (float32 vs float64 arithmetic could flip
  a near-tie; MAX_SET_FLIPS documents the tolerance, measured 0 here) and the per-batch
  relative error agrees to 1e-4 (relative).
* Real-looking K/V (a large common offset, outlier channels, heavy-tailed norms and a
  dictionary learned on them by the forge): the same error criterion.
* Ill-conditioned inputs (duplicate and antiparallel atoms, zero vectors, s = head_dim,
  dead metric directions): valid codes — distinct in-range indices, finite coefficients.
* Residual stage: the GPU's words equal residual.quantise applied to x − decode(GPU codes).
* Per-head dictionaries, metric dictionaries, encode_into with guard words, typed errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import codec, residual
from kvdict_vk import errors as E
from kvdict_vk.dictionary import StreamDict

pytestmark = pytest.mark.gpu

# Fraction of vectors whose atom set may differ from codec.omp's on well-conditioned input:
# float32 correlations (both sides use them) summed in another order can reorder two atoms
# whose normalised correlations agree to ~1e-7. Measured: 0 flips in every case below
# (~12 000 vectors) and in 74 000 more (d 64/K 1024/s 8 Gaussian and learned-dictionary
# K/V, d 128/K 4096/s 16); the binary16 coefficients then differ in ~0.03 % of code words,
# by 1–3 units in the last place (float32 vs float64 before rounding).
MAX_SET_FLIPS = 0.002
REL_ERR_TOL = 1e-4  # |err_gpu − err_cpu| / err_cpu, per batch
GUARD = 0x7FA5A5A5


def unit_atoms(rng, heads: int, n_atoms: int, head_dim: int) -> np.ndarray:
    a = rng.standard_normal((heads, n_atoms, head_dim))
    return (a / np.linalg.norm(a, axis=2, keepdims=True)).astype(np.float32)


def kv_like(rng, n_kv: int, n: int, head_dim: int) -> np.ndarray:
    """Synthetic K/V with what real caches show: a large common offset, a few outlier
    channels, low-rank heavy-tailed structure and heavy-tailed token norms."""
    offset = 4.0 * rng.standard_normal(head_dim)
    mix = rng.standard_normal((head_dim // 2, head_dim)) / np.sqrt(head_dim)
    chan = np.ones(head_dim)
    chan[rng.choice(head_dim, 3, replace=False)] = 15.0
    z = rng.standard_t(3, size=(n_kv, n, head_dim // 2))
    x = z @ mix + 0.1 * rng.standard_normal((n_kv, n, head_dim))
    norms = rng.lognormal(0.0, 0.6, (n_kv, n, 1))
    return (offset + x * chan * norms).astype(np.float32)


def set_agreement(gpu: np.ndarray, cpu: np.ndarray, s: int) -> float:
    gi, _ = codec.unpack_codes(gpu[..., :s])
    ci, _ = codec.unpack_codes(cpu[..., :s])
    return float(np.mean((np.sort(gi, -1) == np.sort(ci, -1)).all(-1)))


def rel_error(x: np.ndarray, slots: np.ndarray, d: StreamDict) -> float:
    rec = codec.decode_heads(slots, d)
    x = x.astype(np.float64)
    return float(np.sum((x - rec) ** 2) / np.sum(x ** 2))


def check_valid(slots: np.ndarray, d: StreamDict) -> None:
    idx, coef = codec.unpack_codes(slots[..., :d.sparsity])
    assert idx.max() < d.n_atoms
    assert np.isfinite(coef).all()
    srt = np.sort(idx, -1)
    assert (np.diff(srt, axis=-1) > 0).all(), "atom indices within a code must be distinct"
    assert np.isfinite(codec.decode_heads(slots, d)).all()


def compare(enc, x, d, what: str) -> tuple[float, float]:
    gpu = enc.encode(x)
    cpu = codec.encode_heads(x, d)
    check_valid(gpu, d)
    agree = set_agreement(gpu, cpu, d.sparsity)
    eg, ec = rel_error(x, gpu, d), rel_error(x, cpu, d)
    print(f"[{what}] same atom sets {agree:.4f}, rel err gpu {eg:.6g} cpu {ec:.6g}, "
          f"diff {abs(eg - ec) / ec:.2e}")
    return agree, abs(eg - ec) / ec


@pytest.fixture(params=["tiled", "vector", "stepwise"])
def encoder(vk_device, request):
    from kvdict_vk.vk.encode.encoder import GpuEncoder
    kernel = "stepwise" if request.param == "stepwise" else "tiled"
    form = {"vector_per_head": 1 << 16} if request.param == "vector" else {}
    made = []

    def make(d, **kw):
        made.append(GpuEncoder(vk_device, d, kernel=kernel, **form, **kw))
        assert made[-1].kernel == kernel
        return made[-1]
    make.kernel = kernel
    yield make
    for e in made:
        e.free()


@pytest.fixture
def auto_encoder(vk_device):
    """kernel="auto": the stepwise form on a CPU driver, the tiled one on a GPU."""
    from kvdict_vk.vk.encode.encoder import GpuEncoder
    made = []

    def make(d):
        made.append(GpuEncoder(vk_device, d))
        assert made[-1].kernel == ("stepwise" if vk_device.is_cpu else "tiled")
        return made[-1]
    yield make
    for e in made:
        e.free()


# (head_dim, n_atoms, s, n_kv, T): every value of head_dim {32, 36, 64, 128}, n_atoms {64,
# 1024, 4096, 65536 (few vectors)} and s {1, 4, 8, 16} appears; 36 has an odd vec4 count.
# T spans the tiled kernel's tile sizes (4, 16, 64 vectors per workgroup) and partial tiles.
WELL_CONDITIONED = [
    (32, 64, 1, 2, 300),
    (36, 1024, 4, 1, 500),
    (64, 1024, 8, 3, 700),
    (64, 1024, 4, 1, 3),
    (64, 512, 4, 1, 13),
    (32, 1024, 16, 1, 256),
    (36, 64, 16, 2, 100),
]
LARGE = [
    (128, 4096, 16, 1, 200),
    (64, 4096, 4, 2, 150),
    (64, 65536, 8, 1, 24),
    (128, 65536, 1, 1, 16),
]


def _same_atoms_case(enc, head_dim, n_atoms, s, n_kv, n_tok):
    rng = np.random.default_rng(head_dim * 7 + n_atoms + s)
    d = StreamDict(unit_atoms(rng, 1, n_atoms, head_dim)[0], sparsity=s)
    x = rng.standard_normal((n_kv, n_tok, head_dim)).astype(np.float32)
    agree, diff = compare(enc(d), x, d, f"d={head_dim} K={n_atoms} s={s}")
    assert agree >= 1 - MAX_SET_FLIPS
    assert diff <= REL_ERR_TOL


@pytest.mark.parametrize("head_dim,n_atoms,s,n_kv,n_tok", WELL_CONDITIONED)
def test_same_atoms_and_error_as_codec(encoder, head_dim, n_atoms, s, n_kv, n_tok):
    _same_atoms_case(encoder, head_dim, n_atoms, s, n_kv, n_tok)


@pytest.mark.parametrize("head_dim,n_atoms,s,n_kv,n_tok", LARGE)
def test_large_dictionaries(auto_encoder, head_dim, n_atoms, s, n_kv, n_tok):
    _same_atoms_case(auto_encoder, head_dim, n_atoms, s, n_kv, n_tok)


def test_real_looking_kv_with_learned_dictionary(encoder):
    """A dictionary learned by the forge (mean, correlated atoms of unequal norm after the
    K-SVD updates) on synthetic K/V; held-out vectors are compared."""
    from kvdict_vk.forge.learn import learn_stream
    rng = np.random.default_rng(7)
    data = kv_like(rng, 1, 3000, 64)[0]
    d, _ = learn_stream(data[:2000], 256, 8, iters=4, seed=1)
    d = StreamDict(d.atoms * rng.uniform(0.5, 2.0, (256, 1)).astype(np.float32), mean=d.mean, sparsity=8)
    x = data[2000:][None]
    agree, diff = compare(encoder(d), x, d, "learned, kv-like")
    assert agree >= 1 - 5 * MAX_SET_FLIPS  # learned atoms are correlated: more near-ties
    assert diff <= REL_ERR_TOL


def test_real_looking_kv_random_dictionary_with_mean(auto_encoder):
    """head_dim 128, s 16: beyond the tiled kernel's loop budget on llvmpipe, so "auto"."""
    rng = np.random.default_rng(8)
    x = kv_like(rng, 2, 400, 128)
    d = StreamDict(rng.standard_normal((1024, 128)).astype(np.float32),
                   mean=x.reshape(-1, 128).mean(0), sparsity=16)
    agree, diff = compare(auto_encoder(d), x, d, "random atoms, kv-like")
    assert agree >= 1 - MAX_SET_FLIPS
    assert diff <= REL_ERR_TOL


def test_per_head_dictionaries(encoder):
    rng = np.random.default_rng(3)
    n_kv, head_dim, n_atoms = 3, 64, 512
    d = StreamDict(unit_atoms(rng, n_kv, n_atoms, head_dim), mean=rng.standard_normal((n_kv, head_dim)),
                   sparsity=8)
    x = rng.standard_normal((n_kv, 130, head_dim)).astype(np.float32)
    agree, diff = compare(encoder(d), x, d, "per-head")
    assert agree >= 1 - MAX_SET_FLIPS and diff <= REL_ERR_TOL
    with pytest.raises(E.ShapeError, match="shape"):
        encoder(d).encode(x[:2])  # a per-head dictionary needs exactly its heads


@pytest.mark.parametrize("head_dim", [32, 64])  # W in one row block / in two
def test_metric_dictionary(encoder, head_dim):
    rng = np.random.default_rng(4)
    metric = (np.eye(head_dim) + 0.3 * rng.standard_normal((head_dim, head_dim))).astype(np.float32)
    metric[:, 0] = 0.0  # a dead direction: atom 5 (along it) is mapped to zero
    atoms = unit_atoms(rng, 1, 300, head_dim)[0]
    atoms[5] = np.eye(head_dim, dtype=np.float32)[0]
    d = StreamDict(atoms, metric=metric, sparsity=6)
    x = rng.standard_normal((2, 100, head_dim)).astype(np.float32)
    gpu = encoder(d).encode(x)
    cpu = codec.encode_heads(x, d)
    check_valid(gpu, d)
    agree = set_agreement(gpu, cpu, 6)
    print(f"[metric] same atom sets {agree:.4f}")
    assert agree >= 1 - MAX_SET_FLIPS
    assert not (codec.unpack_codes(gpu[..., :6])[0] == 5).any()  # never useful


# --- ill-conditioned inputs -------------------------------------------------------------

def test_degenerate_inputs_give_valid_codes(encoder, auto_encoder):
    rng = np.random.default_rng(5)
    head_dim = 32
    base = unit_atoms(rng, 1, 40, head_dim)[0]
    atoms = np.concatenate([base, base[:10], -base[10:20], 3.0 * base[:5]])  # dup, antiparallel, scaled
    x = rng.standard_normal((1, 200, head_dim)).astype(np.float32)
    x[0, :20] = 0.0  # zero vectors
    x[0, 20:40] = atoms[rng.integers(0, len(atoms), 20)] * 2.5  # exactly one atom
    x[0, 40:60] = atoms[3] + atoms[40 + 3] * 1e-3  # almost-dependent combinations
    for s in (4, head_dim):  # s = head_dim: the span is exhausted, later picks are dependent
        d = StreamDict(atoms, sparsity=s)
        # s = head_dim is beyond the tiled kernel's loop budget on llvmpipe: there "auto"
        # (stepwise on a CPU driver, tiled on a GPU)
        gpu = (encoder(d) if s < head_dim else auto_encoder(d)).encode(x)
        check_valid(gpu, d)
        idx, coef = codec.unpack_codes(gpu[..., :s])
        assert (coef[0, :20] == 0).all() and (np.sort(idx[0, :20], -1) == np.arange(s)).all()
        err = np.sum((codec.decode_heads(gpu, d) - x) ** 2, -1)
        assert err[0, 20:40].max() <= 1e-4 * np.sum(x[0, 20:40] ** 2, -1).max()


def test_duplicate_dictionary_only(encoder):
    """Every atom the same direction: after the first pick all are dependent."""
    rng = np.random.default_rng(6)
    v = rng.standard_normal(16).astype(np.float32)
    atoms = np.stack([v, -v, 2 * v, v, 0.5 * v, -3 * v, v, v]).astype(np.float32)
    d = StreamDict(atoms, sparsity=8)
    x = rng.standard_normal((1, 70, 16)).astype(np.float32)
    gpu = encoder(d).encode(x)
    check_valid(gpu, d)
    _, coef = codec.unpack_codes(gpu[..., :8])
    assert (np.count_nonzero(coef, -1) <= 1).all()


# --- residual stage ------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim,bits", [(64, 4), (36, 3), (32, 1), (128, 8), (64, 2)])
def test_residual_words_equal_quantise(encoder, head_dim, bits):
    rng = np.random.default_rng(head_dim + bits)
    scale = rng.uniform(0.3, 3.0, head_dim).astype(np.float32)
    d = StreamDict(unit_atoms(rng, 1, 512, head_dim)[0], mean=rng.standard_normal(head_dim),
                   sparsity=8, residual_bits=bits, residual_scale=scale)
    x = kv_like(rng, 2, 300, head_dim)
    x[0, :5] = d.mean  # zero residual after the mean: every step candidate is 0
    gpu = encoder(d).encode(x)
    s = d.sparsity
    ref = np.stack([residual.quantise(x[h].astype(np.float64) - codec.reconstruct(gpu[h, :, :s], d.atoms[0], d.mean[0]),
                                      scale, bits) for h in range(2)])
    same = (ref == gpu[..., s:]).all(-1)
    print(f"[residual b={bits}] identical stages {same.mean():.5f}")
    assert same.all()
    cpu = codec.encode_heads(x, d)
    agree = set_agreement(gpu, cpu, s)
    whole = float((cpu == gpu).all(-1).mean())
    print(f"[residual b={bits}] same atom sets {agree:.4f}, identical slots {whole:.4f}")
    assert agree >= 1 - MAX_SET_FLIPS


# --- encode_into, capacity, errors --------------------------------------------------------------

def test_encode_into_writes_only_its_slots(encoder, vk_device):
    """Two appends into a guarded buffer at the arena's addressing: exactly the slots of
    tokens [0, 45) of both heads change, and they equal encode()'s words."""
    from kvdict_vk.vk.device import kp
    from kvdict_vk.vk.kernels import Buffer, run
    rng = np.random.default_rng(9)
    d = StreamDict(unit_atoms(rng, 1, 200, 32)[0], sparsity=4, residual_bits=2,
                   residual_scale=np.ones(32, np.float32))
    enc = encoder(d)
    n_kv, n_ctx, sw, region = 2, 50, d.slot_words, 100
    words = region + n_kv * n_ctx * sw + 100
    dest = Buffer(vk_device, words, "device", "dest", init=np.full(words, GUARD, np.uint32))
    try:
        run(vk_device, kp.OpTensorSyncDevice([dest.tensor]))
        x1 = rng.standard_normal((n_kv, 30, 32)).astype(np.float32)
        x2 = rng.standard_normal((n_kv, 15, 32)).astype(np.float32)
        enc.encode_into(dest, x1, region, n_ctx, 0)
        enc.encode_into(dest, x2, region, n_ctx, 30)
        run(vk_device, kp.OpTensorSyncLocal([dest.tensor]))
        got = np.array(dest.host_words())
    finally:
        dest.destroy()
    region_words = got[region:region + n_kv * n_ctx * sw].reshape(n_kv, n_ctx, sw)
    assert np.array_equal(region_words[:, :30], enc.encode(x1))
    assert np.array_equal(region_words[:, 30:45], enc.encode(x2))
    assert (region_words[:, 45:] == GUARD).all()
    assert (got[:region] == GUARD).all() and (got[region + n_kv * n_ctx * sw:] == GUARD).all()


def test_batches_larger_than_capacity(encoder):
    rng = np.random.default_rng(10)
    d = StreamDict(unit_atoms(rng, 1, 100, 16)[0], sparsity=8)
    enc = encoder(d, max_batch=64)
    assert enc.capacity == 64
    x = rng.standard_normal((2, 150, 16)).astype(np.float32)
    gpu = enc.encode(x)
    assert set_agreement(gpu, codec.encode_heads(x, d), 8) >= 1 - MAX_SET_FLIPS
    assert enc.encode(x[:, :0]).shape == (2, 0, 8)


def test_typed_errors(encoder, vk_device):
    from kvdict_vk.vk.kernels import Buffer
    rng = np.random.default_rng(11)
    d = StreamDict(unit_atoms(rng, 1, 64, 32)[0], sparsity=2)
    enc = encoder(d)
    x = rng.standard_normal((1, 10, 32)).astype(np.float32)
    for bad in (x.astype(np.float64), x[0], x[..., :31], list(x), np.full_like(x, np.nan),
                np.full_like(x, 1e30)):
        with pytest.raises(E.ShapeError):
            enc.encode(bad)
    dest = Buffer(vk_device, 100, "storage", "small dest")
    try:
        for args, match in [((x, 0, 10, 1), "n_ctx"), ((x, 90, 10, 0), "end at word"),
                            ((x, -1, 10, 0), "non-negative"), ((x, 0, 10, 0.5), "non-negative")]:
            with pytest.raises(E.DispatchError, match=match):
                enc.encode_into(dest, *args)
        with pytest.raises(E.DispatchError, match="own buffers"):
            enc.encode_into(enc._buffers["out"], x, 0, 10, 0)
        enc.encode_into(dest, x, 80, 10, 0)  # exactly fits: words 80..99
    finally:
        dest.destroy()
    with pytest.raises(E.DispatchError, match="live Buffer"):
        enc.encode_into(dest, x, 0, 10, 0)
    enc.free()
    with pytest.raises(E.ArenaError, match="freed"):
        enc.encode(x)


def test_scalar_variant_head_dim_not_a_multiple_of_4(encoder):
    rng = np.random.default_rng(12)
    d = StreamDict(unit_atoms(rng, 1, 256, 50)[0], sparsity=4, residual_bits=3,
                   residual_scale=rng.uniform(0.5, 2, 50).astype(np.float32))
    x = rng.standard_normal((2, 80, 50)).astype(np.float32)
    enc = encoder(d)
    assert "scalar" in enc._variants["corr"]
    agree, diff = compare(enc, x, d, "d=50 scalar")
    assert agree >= 1 - MAX_SET_FLIPS and diff <= REL_ERR_TOL


def test_llvmpipe_loop_cap_is_refused(vk_device):
    """A pick kernel that would run past llvmpipe's silent 65535-loop-iteration cap is refused
    before anything is allocated (other drivers have no such cap)."""
    from kvdict_vk.vk.encode.encoder import GpuEncoder
    if "llvmpipe" not in vk_device.name.lower():
        pytest.skip("llvmpipe only")
    rng = np.random.default_rng(13)
    d = StreamDict(unit_atoms(rng, 1, 256, 256)[0], sparsity=250)
    with pytest.raises(E.DispatchError, match="65535"):
        GpuEncoder(vk_device, d)
    big = StreamDict(unit_atoms(rng, 1, 65536, 64)[0], sparsity=8)
    with pytest.raises(E.DispatchError, match="65535"):
        GpuEncoder(vk_device, big, kernel="tiled")
    with pytest.raises(E.ShapeError, match="kernel"):
        GpuEncoder(vk_device, big, kernel="fast")


def test_dispatch_contracts_are_checked():
    """The encoder's registry entries refuse inconsistent push constants (pure Python)."""
    from kvdict_vk.vk.kernels import SHADERS
    spec = {"DIM": 32, "SPARSITY": 4, "ATOM_BLOCK": 16}
    push = dict(phase=1, step=0, group0=0, block=0, dict_head=0, n_tok=10, n_vectors=20, n_atoms=64,
                per_head=0, atoms_word=0, inv_norm_word=0, mean_word=0, metric_word=0, raw_atoms_word=0,
                scale_word=0, steps_word=0, res_word=0, basis_word=0, dst_word=0, n_ctx=10, t0=0)
    SHADERS["omp_encode_pick_vec4"].extents(push, spec)
    SHADERS["omp_encode_corr_vec4"].extents(push, spec)
    for bad, shader in [(dict(step=4), "pick"), (dict(t0=1), "pick"), (dict(n_vectors=15), "pick"),
                        (dict(block=4), "corr"), (dict(dict_head=1), "corr"), (dict(per_head=2), "corr")]:
        with pytest.raises(E.DispatchError):
            SHADERS[f"omp_encode_{shader}_vec4"].extents({**push, **bad}, spec)
    tiled = {"DIM": 32, "SPARSITY": 4, "TILE_VECTORS": 16, "LOCAL": 64, "CHUNK_DIMS": 32, "METRIC": 0}
    push.update(atoms_pad=64, dst_word=7, atoms_t_word=100)
    spans = SHADERS["omp_encode_tiled_vec4"].extents(push, tiled)
    assert spans[0] == [(0, 20 * 32)] and spans[5] == [(7, 7 + 20 * 4)]  # input; 2 heads × 10 slots
    assert (100, 100 + 64 * 32) in spans[2]  # the transposed atoms
    for bad in (dict(atoms_pad=63), dict(t0=1), dict(n_vectors=15), dict(per_head=2)):
        with pytest.raises(E.DispatchError):
            SHADERS["omp_encode_tiled_vec4"].extents({**push, **bad}, tiled)


# --- the tiled form's launch shapes (pure Python: a device's limits, no dispatch) ------------

class _Limits:
    """A stand-in for a Device: its name and the limits encode_tiled reads."""

    def __init__(self, shared: int, invocations: int, name: str = "some GPU"):
        self.name = name
        self._lim = {"max_compute_shared_memory_size": shared, "max_compute_work_group_invocations": invocations,
                     "max_compute_work_group_size": (invocations, invocations, 64),
                     "max_compute_work_group_count": (65535, 65535, 65535)}

    def limit(self, key):
        return self._lim[key]


@pytest.mark.parametrize("shared,invocations", [(48 << 10, 1024), (32 << 10, 256), (16 << 10, 128)])
@pytest.mark.parametrize("head_dim,s,n_steps", [(64, 4, 15), (128, 16, 15), (36, 4, 0), (256, 8, 15)])
def test_tiled_shapes_fit_the_device(shared, invocations, head_dim, s, n_steps):
    """Every requested tile size gets a shape within the device's shared memory and
    workgroup limits (16 KiB and 128 invocations are Vulkan's minimum), falling back to
    smaller tiles where needed; 4-vector tiles stage no atoms."""
    from kvdict_vk.vk.encode import tiled as T
    dev = _Limits(shared, invocations)
    for tv in T.TILE_SIZES:
        try:
            shape = T.tile_shape(dev, head_dim, s, tv, n_steps)
        except E.DispatchError:
            # only where even a 4-vector tile cannot hold u (8 B × head_dim × 4) and the rest
            assert T.shared_bytes(head_dim, s, T.TileShape(4, 64, 0), n_steps) > min(shared, T.SHARED_BUDGET)
            continue
        assert shape.tile_vectors <= tv and shape.tile_vectors % 4 == 0
        assert shape.local <= invocations and shape.local % (shape.tile_vectors // 4) == 0
        assert T.shared_bytes(head_dim, s, shape, n_steps) <= min(shared, T.SHARED_BUDGET)
        assert (shape.chunk_dims == 0) == (shape.tile_vectors == 4)
        assert shape.chunk_dims == 0 or head_dim % shape.chunk_dims == 0


def test_tiled_tile_sizes_follow_the_batch():
    """A decode step's few vectors per dictionary head take the vector form, larger batches
    the largest tile (the smaller ones: where it does not fit, and the vector form's stand-in)."""
    from kvdict_vk.vk.encode.tiled import TILE_SIZES, VECTOR_FORM, tile_for
    from kvdict_vk.vk.encode.vector import MAX_PER_HEAD
    assert [tile_for(n) for n in (1, 4, MAX_PER_HEAD, MAX_PER_HEAD + 1, 100_000)] == [VECTOR_FORM] * 3 + [64, 64]
    assert TILE_SIZES == tuple(sorted(TILE_SIZES, reverse=True)) and TILE_SIZES[0] == 64


@pytest.mark.parametrize("shared,invocations", [(48 << 10, 1024), (32 << 10, 256), (16 << 10, 128)])
@pytest.mark.parametrize("head_dim,s,n_steps", [(64, 4, 15), (128, 16, 15), (36, 4, 0), (256, 8, 15), (20, 1, 3)])
def test_vector_shapes_fit_the_device(shared, invocations, head_dim, s, n_steps):
    """The vector form's shape fits the device's shared memory and workgroup limits (down
    to Vulkan's minimum) or there is none, only where even the smallest workgroup's arrays
    do not fit; its trees need powers of two, each reduction at most one partial per
    invocation, and no more partials than elements."""
    from kvdict_vk.vk.encode import vector as V
    dev = _Limits(shared, invocations)
    shape = V.vector_shape(dev, head_dim, s, n_steps)
    budget = min(shared, V.SHARED_BUDGET)
    if shape is None:
        assert all(V.shared_bytes(head_dim, s, c, n_steps) > budget
                   for c in V.candidate_shapes(dev, head_dim, s, n_steps))
        return
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    assert shape.local <= invocations and pow2(shape.local)
    assert V.shared_bytes(head_dim, s, shape, n_steps) <= budget
    assert pow2(shape.sum_f) and shape.sum_f <= head_dim and shape.sum_f * max(2, s - 1) <= shape.local
    if n_steps:
        assert pow2(shape.sum_d) and shape.sum_d <= head_dim and shape.sum_d * n_steps <= shape.local
    else:
        assert shape.sum_d == 0


def test_vector_form_under_llvmpipes_loop_cap():
    """On llvmpipe the vector form is kept only while one invocation's counted loops stay
    under the cap (else the small tile stands in); elsewhere it is kept whatever the count."""
    from kvdict_vk.vk.encode import tiled as T
    from kvdict_vk.vk.encode import vector as V
    rng = np.random.default_rng(16)
    cpu, gpu = _Limits(32 << 10, 1024, name="llvmpipe (LLVM 15)"), _Limits(48 << 10, 1024)
    for n_atoms, head_dim, s, expect_kept in ((256, 16, 2, True), (1 << 16, 128, 16, False)):
        d = StreamDict(unit_atoms(rng, 1, n_atoms, head_dim)[0], sparsity=s)
        shape = V.vector_shape(cpu, head_dim, s, 0)
        loops = V.loop_iterations(head_dim, s, n_atoms, shape, 0, 0, False, 1)
        assert (loops <= T.LOOP_BUDGET) == expect_kept
        kept = {}
        for dev in (cpu, gpu):
            try:
                kept[dev.name] = T.TiledKernels(dev, d, ("t", "v"), None, None, 256, 0).vector is not None
            except E.DispatchError:  # the tiled form itself refused under the cap: no vector form either
                kept[dev.name] = False
        assert kept == {cpu.name: expect_kept, gpu.name: True}


def test_vector_form_and_its_stand_in(vk_device, monkeypatch):
    """kernel="tiled": a batch of few vectors per dictionary head runs the vector form, a
    larger one the tiled kernel; where the vector form does not fit, the small tile takes
    its batches — each giving the codec's slots (residual stage included)."""
    from kvdict_vk.vk.encode import vector as V
    from kvdict_vk.vk.encode.encoder import GpuEncoder
    rng = np.random.default_rng(15)
    n_kv, head_dim = 3, 32
    d = StreamDict(unit_atoms(rng, n_kv, 256, head_dim), mean=rng.standard_normal((n_kv, head_dim)), sparsity=4,
                   residual_bits=3, residual_scale=rng.uniform(0.5, 2.0, (n_kv, head_dim)).astype(np.float32))
    x = kv_like(rng, n_kv, V.MAX_PER_HEAD + 3, head_dim)
    forms = {}
    for fits in (True, False):
        if not fits:
            monkeypatch.setattr(V, "vector_shape", lambda *a, **k: None)
        with GpuEncoder(vk_device, d, kernel="tiled") as enc:
            for n_tok in (1, V.MAX_PER_HEAD, V.MAX_PER_HEAD + 3):
                slots = enc.encode(x[:, :n_tok])
                ref = codec.encode_heads(x[:, :n_tok], d)
                assert (slots == ref).all(-1).mean() >= 1 - MAX_SET_FLIPS
            forms[fits] = {tv: s["form"] for tv, s in enc.launch_shapes().items()}
    assert forms[True] == {"1": "vector", "64": "tiled"}
    assert forms[False] == {"4": "tiled", "64": "tiled"}
    for bad in (-1, 2.0, True):
        with pytest.raises(E.ShapeError):
            GpuEncoder(vk_device, d, kernel="tiled", vector_per_head=bad)


def test_tiled_llvmpipe_batches_take_one_pass():
    """On llvmpipe a batch is at most what the largest tile's workgroups cover in one pass
    (each workgroup one tile: its loops stay under the cap); elsewhere what was asked."""
    from kvdict_vk.vk.encode import tiled as T
    rng = np.random.default_rng(14)
    d = StreamDict(unit_atoms(rng, 1, 256, 64)[0], sparsity=8)
    assert T.max_batch(_Limits(48 << 10, 1024), d, 65536) == 65536
    cpu = _Limits(32 << 10, 1024, name="llvmpipe (LLVM 15)")
    n = T.max_batch(cpu, d, 65536)
    tv = T.tile_shape(cpu, 64, 8, T.TILE_SIZES[0], 0).tile_vectors
    per_wg = max(8 * 64, 8 * 8 + 16) * tv
    assert n % tv == 0 and n // tv + d.n_heads <= min(T.MAX_WORKGROUPS, T.STATE_WORDS_CAP // per_wg)
