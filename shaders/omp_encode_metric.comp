#version 450
// GPU OMP encoder, metric streams only: r = W (x - mean) for every vector of the batch, so OMP
// works in the metric's space (where the dictionary image holds the mapped, normalised atoms).
// The pick kernel's start phase leaves x - mean in the basis area (unused before step 0);
// one dispatch maps rows block*METRIC_ROWS .. +METRIC_ROWS of W into the residual area.
// Lanes = vectors, so every lane reads the same rows of W (uniform loads: their addresses
// come from push constants and constants only); straight-line code like omp_encode_corr
// (encode_common.glsl). The host dispatches exact workgroup counts.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require  // [[unroll]]: core SPIR-V LoopControl
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint DIM = 64u;
layout(constant_id = 1) const uint METRIC_ROWS = 32u;  // a multiple of LANES (or DIM itself)
const uint DIM_ELEMS = DIM / LANES;

layout(std430, binding = 0) readonly buffer DictElems { FELEM dict_elems[]; };
layout(std430, binding = 1) buffer StateElems { FELEM state_elems[]; };

#include "encode_common.glsl"

void main() {
    uint n_groups = (pc.n_vectors + WG_SIZE - 1u) / WG_SIZE;
    uint wanted = pc.group0 + gl_WorkGroupID.x;
    uint v = min(wanted, n_groups - 1u) * WG_SIZE + gl_LocalInvocationID.x;
    bool live = all(bvec2(wanted < n_groups, v < pc.n_vectors));
    uint vec_index = min(v, pc.n_vectors - 1u);

    float centred[DIM];
    uint src_elem = pc.basis_word / LANES + vec_index * DIM_ELEMS;
    LOAD_ROW(centred, state_elems, src_elem);
    uint first = pc.block * METRIC_ROWS;
    uint w_elem = pc.metric_word / LANES;
    float mapped[METRIC_ROWS];
    [[unroll]] for (uint r = 0u; r < METRIC_ROWS; ++r) {
        ATOM_DOT(mapped[r], w_elem, min(first + r, DIM - 1u), centred);  // rows past DIM: unused
        if ((r & 3u) == 3u)
            barrier();  // pieces for llvmpipe's code generator (see omp_encode_corr.comp)
    }
    if (live) {
        uint dst_elem = pc.res_word / LANES + vec_index * DIM_ELEMS + first / LANES;
        [[unroll]] for (uint e = 0u; e < METRIC_ROWS / LANES; ++e) {
            if (first + e * LANES < DIM)
                state_elems[dst_elem + e] = ARRAY_ELEM(mapped, e);
        }
    }
}
