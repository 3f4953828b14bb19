#version 450
// Dictionary reconstruction of one stream of one layer for a token range:
//   out[h, i, :] = mean + sum_j coef_j * atoms[idx_j, :]   for h < n_kv, t0 <= t0 + i < t0 + n_tok
// reading the code words (word(h,t,j) = src_word + (h*n_ctx + t)*S + j), the stream's
// atoms block and its mean straight from the layer buffer.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require  // [[dont_unroll]]: core SPIR-V LoopControl
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;
layout(constant_id = 1) const uint SPARSITY = 8u;
// Output chunks (LANES floats each) per invocation and row: 1 on GPUs (neighbouring
// invocations write neighbouring chunks: coalesced), a whole row on CPU drivers (the code
// words of a row are then read exactly once per row).
layout(constant_id = 2) const uint CHUNKS = 1u;

const uint ROW_CHUNKS = HEAD_DIM / LANES;
const uint GROUPS = ROW_CHUNKS / CHUNKS;  // invocations per row

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) readonly buffer LayerElems { FELEM layer_elems[]; };
layout(std430, binding = 2) writeonly buffer OutElems { FELEM out_elems[]; };

layout(push_constant) uniform ReconstructPush {
    uint src_word;    // start of the stream's code region
    uint atoms_word;  // start of the stream's atoms block (multiple of LANES)
    uint mean_word;   // start of the stream's mean (multiple of LANES)
    uint n_atoms;
    uint n_ctx;
    uint t0;
    uint n_tok;
    uint n_rows;      // n_kv * n_tok
    uint out_word;    // output row r = h*n_tok + i starts at out_word + r*HEAD_DIM
} pc;

void main() {
    uint gid = gl_GlobalInvocationID.x;
    // The host makes grid_stride() a multiple of GROUPS, so an invocation keeps the same
    // chunk group for every row it visits.
    uint group = gid % GROUPS;
    uint row_step = grid_stride() / GROUPS;
    uint atoms_elem = pc.atoms_word / LANES;
    uint out_elem = pc.out_word / LANES;

    // The invocation's part of the mean, loaded once for every row it visits (a register
    // on GPUs; a small private array on CPU drivers — reloading it per row costs llvmpipe
    // one more scalarised load per output chunk, ~30% at s = 1).
    FELEM mean_part[CHUNKS];
    for (uint k = 0u; k < CHUNKS; ++k)
        mean_part[k] = layer_elems[pc.mean_word / LANES + group + k * GROUPS];

    for (uint row = gid / GROUPS; row < pc.n_rows; row += row_step) {
        uint head = row / pc.n_tok;
        uint token = pc.t0 + (row - head * pc.n_tok);
        uint code_word = pc.src_word + (head * pc.n_ctx + token) * SPARSITY;

        // Unpack the row's code words once; the inner loop below is branch-free.
        uint atom_elem[SPARSITY];
        float coef[SPARSITY];
        for (uint j = 0u; j < SPARSITY; ++j) {
            uint w = layer_words[code_word + j];
            uint atom = code_atom(w);
            atom_elem[j] = atoms_elem + safe_atom(atom, pc.n_atoms) * ROW_CHUNKS;
            coef[j] = safe_coef(atom, pc.n_atoms, code_coef(w));
        }
        // Not unrolled: llvmpipe expands every buffer load into a loop over its SIMD lanes,
        // so unrolling CHUNKS x SPARSITY loads makes its compile time explode (a minute at
        // s = 32, head_dim 64). The SPARSITY loop is unrolled: coef/atom_elem stay registers.
        [[dont_unroll]] for (uint k = 0u; k < CHUNKS; ++k) {
            uint chunk = group + k * GROUPS;
            FELEM acc = mean_part[k];
            for (uint j = 0u; j < SPARSITY; ++j)
                acc += coef[j] * layer_elems[atom_elem[j] + chunk];
            out_elems[out_elem + row * ROW_CHUNKS + chunk] = acc;
        }
    }
}
