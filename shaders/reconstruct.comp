#version 450
// Dictionary reconstruction of one stream of one layer for a token range:
//   out[h, i, :] = mean[g] + sum_j coef_j * atoms[g, idx_j, :] + residual[h, t0 + i, :]
// for h < n_kv, i < n_tok, where g = h with per-head dictionaries and g = 0 when one
// dictionary is shared (the host passes the per-head strides head_atoms / head_vec, 0 when
// shared). Slots: word(h,t,j) = src_word + (h*n_ctx + t)*SLOT_WORDS + j; a slot is SPARSITY
// code words then, when RES_BITS > 0, the residual stage (common.glsl). Atoms, means and
// residual scales are read straight from the layer buffer's tail.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require  // [[dont_unroll]]: core SPIR-V LoopControl
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;
layout(constant_id = 1) const uint SPARSITY = 8u;
// Output chunks (LANES floats each) per invocation and row: on GPUs a few (the host's
// arena.RECONSTRUCT_GPU_CHUNKS, measured; neighbouring invocations write neighbouring chunks:
// coalesced, and a row's code words are unpacked by fewer invocations), a whole row on CPU
// drivers (the slot of a row is then read exactly once per row).
layout(constant_id = 2) const uint CHUNKS = 1u;
// Bits per residual level, 0 = no residual stage (the residual code is compiled out).
layout(constant_id = 3) const uint RES_BITS = 0u;

const uint ROW_CHUNKS = HEAD_DIM / LANES;
const uint GROUPS = ROW_CHUNKS / CHUNKS;  // invocations per row
const uint LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, RES_BITS);
const uint SLOT_WORDS = SLOT_WORDS_OF(SPARSITY, HEAD_DIM, RES_BITS);
const uint RES_MASK = (1u << RES_BITS) - 1u;
// Whether a chunk's levels can straddle two words (LANES*RES_BITS does not divide 32).
const bool RES_STRADDLES = RES_BITS > 0u && (32u % (LANES * RES_BITS + (RES_BITS == 0u ? 1u : 0u))) != 0u;
// Whether an invocation writes whole rows (CPU drivers): it then copies a row's level words
// once into a private array (>= 1 element: GLSL has no empty arrays) instead of reading
// each chunk's words from the slot.
const bool WHOLE_ROWS = CHUNKS == ROW_CHUNKS;
const uint LEVEL_COPY = WHOLE_ROWS ? LEVEL_WORDS + 1u : 1u;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) readonly buffer LayerElems { FELEM layer_elems[]; };
layout(std430, binding = 2) writeonly buffer OutElems { FELEM out_elems[]; };

layout(push_constant) uniform ReconstructPush {
    uint src_word;    // start of the stream's slot region
    uint atoms_word;  // start of the stream's atoms block (multiple of LANES)
    uint mean_word;   // start of the stream's means (multiple of LANES)
    uint n_atoms;
    uint n_ctx;
    uint t0;
    uint n_tok;
    uint n_rows;      // n_kv * n_tok
    uint out_word;    // output row r = h*n_tok + i starts at out_word + r*HEAD_DIM
    uint scale_word;  // start of the stream's residual scales (read only if RES_BITS > 0)
    uint head_atoms;  // words between two KV heads' atoms (0: one shared dictionary)
    uint head_vec;    // words between two KV heads' means / scales (0: shared)
} pc;

// The residual of chunk `chunk` of a row: LANES levels starting at element chunk*LANES.
// A chunk's levels span at most two words (LANES*RES_BITS <= 32 bits, any bit offset): they
// are taken as one window of bits, then each level at a constant shift.
FELEM residual_chunk(uint lw0, uint lw1, uint chunk, float step_, FELEM scale) {
    uint off = (chunk * LANES * RES_BITS) & 31u;
    uint bits = off == 0u ? lw0 : (lw0 >> off) | (lw1 << (32u - off));
    FELEM r;
#if VEC4
    [[unroll]] for (uint i = 0u; i < LANES; ++i)
        r[i] = centred_level((bits >> (i * RES_BITS)) & RES_MASK, RES_BITS);
#else
    r = centred_level(bits & RES_MASK, RES_BITS);
#endif
    return r * step_ * scale;
}

void main() {
    uint gid = gl_GlobalInvocationID.x;
    // The host makes grid_stride() a multiple of GROUPS, so an invocation keeps the same
    // chunk group for every row it visits.
    uint group = gid % GROUPS;
    uint row_step = grid_stride() / GROUPS;
    uint out_elem = pc.out_word / LANES;

    // The invocation's part of its head's mean and residual scale, reloaded only when the
    // head changes (a register on GPUs; a small private array on CPU drivers — reloading
    // per row costs llvmpipe one more scalarised load per output chunk, ~30% at s = 1).
    FELEM mean_part[CHUNKS];
    FELEM scale_part[CHUNKS];
    uint cached_head = 0xFFFFFFFFu;
    uint level_copy[LEVEL_COPY];

    for (uint row = gid / GROUPS; row < pc.n_rows; row += row_step) {
        uint head = row / pc.n_tok;
        uint token = pc.t0 + (row - head * pc.n_tok);
        uint slot = pc.src_word + (head * pc.n_ctx + token) * SLOT_WORDS;
        if (head != cached_head) {
            cached_head = head;
            uint vec_elem = (pc.mean_word + head * pc.head_vec) / LANES;
            uint scale_elem = (pc.scale_word + head * pc.head_vec) / LANES;
            [[dont_unroll]] for (uint k = 0u; k < CHUNKS; ++k) {
                mean_part[k] = layer_elems[vec_elem + group + k * GROUPS];
                if (RES_BITS > 0u)
                    scale_part[k] = layer_elems[scale_elem + group + k * GROUPS];
            }
        }
        uint atoms_elem = (pc.atoms_word + head * pc.head_atoms) / LANES;

        // Unpack the row's code words once; the inner loop below is branch-free.
        uint atom_elem[SPARSITY];
        float coef[SPARSITY];
        [[dont_unroll]] for (uint j = 0u; j < SPARSITY; ++j) {
            uint w = layer_words[slot + j];
            uint atom = code_atom(w);
            atom_elem[j] = atoms_elem + safe_atom(atom, pc.n_atoms) * ROW_CHUNKS;
            coef[j] = safe_coef(atom, pc.n_atoms, code_coef(w));
        }
        float step_ = 0.0;
        if (RES_BITS > 0u) {
            step_ = uintBitsToFloat(layer_words[slot + SPARSITY + LEVEL_WORDS]);
            if (WHOLE_ROWS) {  // CPU drivers: every level word of the row read once
                [[dont_unroll]] for (uint w = 0u; w < LEVEL_WORDS; ++w)
                    level_copy[w] = layer_words[slot + SPARSITY + w];
                level_copy[LEVEL_COPY - 1u] = 0u;
            }
        }
        // Not unrolled: llvmpipe expands every buffer load into a loop over its SIMD lanes
        // (with a bounds check per component), so unrolled loads make its compile time
        // explode (a minute at s = 32, head_dim 64). Keeping the SPARSITY loop rolled too
        // measured no slower (coef/atom_elem become a small private array) and compiles
        // 2-4x faster; GPU compilers unroll it anyway.
        [[dont_unroll]] for (uint k = 0u; k < CHUNKS; ++k) {
            uint chunk = group + k * GROUPS;
            FELEM acc = mean_part[k];
            [[dont_unroll]] for (uint j = 0u; j < SPARSITY; ++j)
                acc += coef[j] * layer_elems[atom_elem[j] + chunk];
            if (RES_BITS > 0u) {
                uint w = (chunk * LANES * RES_BITS) >> 5u;
                uint lw0, lw1;
                if (WHOLE_ROWS) {
                    lw0 = level_copy[w];
                    lw1 = level_copy[w + 1u];  // the padding word past the last
                } else {
                    // GPUs: read the (at most) two words this chunk's levels span; the
                    // second is inside the slot (a level word or the step) whenever used,
                    // and not read at all when no chunk straddles
                    lw0 = layer_words[slot + SPARSITY + w];
                    lw1 = RES_STRADDLES ? layer_words[slot + SPARSITY + min(w + 1u, LEVEL_WORDS)] : 0u;
                }
                acc += residual_chunk(lw0, lw1, chunk, step_, scale_part[k]);
            }
            out_elems[out_elem + row * ROW_CHUNKS + chunk] = acc;
        }
    }
}
