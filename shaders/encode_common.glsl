// Shared by the GPU OMP encoder's shaders (omp_encode_*.comp; host side kvdict_vk/vk/encoder.py).
// Two forms: omp_encode_tiled.comp (GPUs: a batch in one dispatch) and the stepwise kernels
// below (llvmpipe).
//
// One OMP step is two dispatches: omp_encode_corr (correlations of every vector with every
// atom; per vector and block of ATOM_BLOCK atoms the best one) and omp_encode_pick (per
// vector: the best of the blocks, Gram-Schmidt, residual update; after the last step the
// coefficients, code words and residual stage, written straight into the destination).
// Why not one loop-per-vector shader: llvmpipe (the CPU Vulkan driver) runs a storage-buffer
// load as a per-lane loop unless its address is uniform AND no loop or branch is open around
// it (measured: ~20 ns vs ~700 ns per vec4 load and 8-lane row). Only straight-line code gets
// the cheap loads, so the n_atoms x DIM correlation loads live in a branch-free, loop-free
// kernel, one workgroup per (64 tokens of one head, ATOM_BLOCK atoms), every lane reading
// the same atoms. llvmpipe also silently ends any loop of an invocation once all its loops
// have run 65535 iterations: the pick kernel's loops are counted by the host
// (encoder.loop_iterations), the correlation kernel has none.
//
// Requires (before inclusion): LANES, FELEM (common.glsl); DIM_ELEMS for LOAD_ROW / STORE_ROW,
// and ATOM_DOT (which also reads dict_elems).

layout(push_constant) uniform EncodePush {
    uint phase;           // pick: 0 = start (r = x - mean), 1 = OMP step `step`
    uint step;            // 0 .. SPARSITY-1
    uint group0;          // first workgroup of this dispatch (a batch takes several)
    uint block;           // corr: the atom block of this dispatch; metric: the row block
    uint dict_head;       // corr: the dictionary head of this dispatch (0 when shared)
    uint n_tok;           // tokens per head in this batch (>= 1)
    uint n_vectors;       // n_kv * n_tok; vector v = h*n_tok + i, its input at v*DIM
    uint n_atoms;
    uint per_head;        // 1: dictionary blocks per KV head, 0: one shared block
    uint atoms_word;      // unit-norm (metric-mapped) atoms [heads][n_atoms padded to ATOM_BLOCK][DIM]
    uint inv_norm_word;   // 1/||metric*atom|| (0: dead atom) [heads][n_atoms]
    uint mean_word;       // [heads][DIM] (zeros when the stream has none)
    uint metric_word;     // [DIM][DIM], row-major
    uint raw_atoms_word;  // residual stage: the atoms as given [heads][n_atoms][DIM]
    uint scale_word;      // residual stage: 1/residual_scale, df64 pairs [heads][DIM][2]
    uint steps_word;      // residual stage: step multipliers, df64 pairs [N_STEPS][2]
    uint res_word;        // state: residual r [n_vectors][DIM]
    uint basis_word;      // state: orthonormal basis [n_vectors][SPARSITY][DIM]
    uint dst_word;        // destination region; slot of token t0+i of head h at
    uint n_ctx;           //   dst_word + (h*n_ctx + t0 + i)*SLOT_WORDS
    uint t0;
    uint atoms_t_word;    // tiled: the unit atoms transposed, [heads][DIM][atoms_pad]
    uint atoms_pad;       // tiled: atoms per head in both unit-atom blocks (n_atoms padded)
    uint x_word;          // where the input vectors start (a multiple of LANES: host-checked)
} pc;

// Element i (LANES floats) of the input vectors (the includer declares x_elems).
#define X_ELEM(i) x_elems[pc.x_word / LANES + (i)]

// Component c of a LANES-wide element.
float elem_at(FELEM v, uint c) {
#if VEC4
    return v[c];
#else
    return v;
#endif
}

// The LANES floats of a private array that make up element e.
#if VEC4
#define ARRAY_ELEM(a, e) vec4(a[(e) * 4u], a[(e) * 4u + 1u], a[(e) * 4u + 2u], a[(e) * 4u + 3u])
float elem_sum(vec4 v) { return (v.x + v.y) + (v.z + v.w); }
#else
#define ARRAY_ELEM(a, e) a[e]
float elem_sum(float v) { return v; }
#endif

// Element-wise moves of a DIM-wide row between a buffer of FELEMs (from element elem0) and a
// private float array, unrolled (the array indexed by constants only).
#define LOAD_ROW(arr, buf, elem0)                                                 \
    [[unroll]] for (uint e_ = 0u; e_ < DIM_ELEMS; ++e_) {                         \
        FELEM w_ = buf[(elem0) + e_];                                             \
        [[unroll]] for (uint c_ = 0u; c_ < LANES; ++c_)                           \
            arr[e_ * LANES + c_] = elem_at(w_, c_);                               \
    }
#define STORE_ROW(buf, elem0, arr)                                                \
    [[unroll]] for (uint e_ = 0u; e_ < DIM_ELEMS; ++e_)                           \
        buf[(elem0) + e_] = ARRAY_ELEM(arr, e_);

// result = <row j of the DIM-wide rows at element base, r>, two accumulators (twice the
// independent add chains). The loop keeps the plain `i < constant; ++i` form: NIR unrolls
// only loops whose trip count it can see, and unrolled is what keeps r in registers and the
// loads outside any loop.
#define ATOM_DOT(result, base, j, r)                                              \
    {                                                                             \
        uint a_ = (base) + (j) * DIM_ELEMS;                                       \
        FELEM acc0_ = FELEM(0.0), acc1_ = FELEM(0.0);                             \
        [[unroll]] for (uint p_ = 0u; p_ < DIM_ELEMS / 2u; ++p_) {                \
            acc0_ += dict_elems[a_ + 2u * p_] * ARRAY_ELEM(r, 2u * p_);           \
            acc1_ += dict_elems[a_ + 2u * p_ + 1u] * ARRAY_ELEM(r, 2u * p_ + 1u); \
        }                                                                         \
        if ((DIM_ELEMS & 1u) != 0u)                                               \
            acc0_ += dict_elems[a_ + DIM_ELEMS - 1u] * ARRAY_ELEM(r, DIM_ELEMS - 1u); \
        result = elem_sum(acc0_ + acc1_);                                         \
    }

// Does correlation c of a later atom beat best_c? codec.omp takes numpy's first argmax of
// corr and first argmin, and the maximum unless -min is strictly larger: visiting atoms in
// ascending index, that is the order (|c|, c >= 0, -index). Branch-free (bool arithmetic)
// so it can sit in the straight-line correlation kernel.
bool corr_beats(float c, float best_c) {
    float a = abs(c), b = abs(best_c);
    return (uint(a > b) | (uint(a == b) & uint(c >= 0.0) & uint(best_c < 0.0))) != 0u;
}

// The same order as a key (correlation c of atom i against the best so far, bc of atom bi),
// for any visiting order (the GPU-shaped encoders, omp_encode_tiled.comp and
// omp_encode_vector.comp, reduce over atoms in a tree): larger |c|; on equal |c| the
// non-negative one (numpy's argmax is taken unless -min is strictly larger); then the lower
// index.
bool key_beats(float c, uint i, float bc, uint bi) {
    float a = abs(c), b = abs(bc);
    if (a != b)
        return a > b;
    bool pos = c >= 0.0, bpos = bc >= 0.0;
    if (pos != bpos)
        return pos;
    return i < bi;
}

// codec._DEPENDENT_NU2: an atom whose squared norm after Gram-Schmidt is at most this is
// dependent (float32 Gram-Schmidt leaves ~1e-14 of an exactly dependent atom).
const float DEPENDENT_NU2 = 1e-10;

const float F16_MAX = 65504.0;

// Code word: atom index | binary16 coefficient << 16. codec.pack_codes refuses a coefficient
// beyond binary16; a shader cannot raise, so it saturates (and maps a NaN, which finite inputs
// never produce, to 0): the word is always a valid, finite code.
uint code_word(uint atom, float c) {
    c = isnan(c) ? 0.0 : clamp(c, -F16_MAX, F16_MAX);
    return (packHalf2x16(vec2(c, 0.0)) << 16u) | atom;
}
