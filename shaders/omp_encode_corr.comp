#version 450
// GPU OMP encoder, the hot half of one step: for every vector of the batch and every block of
// ATOM_BLOCK atoms, the atom of largest |<atom, r>| (unit atoms, so normalised correlation)
// by codec.omp's rule, as a key (correlation bits, atom index).
// A dispatch = one block of ATOM_BLOCK atoms of one dictionary head (push constants `block`,
// `dict_head`), a workgroup = 64 tokens of one KV head (tiles group0 ..); lanes = tokens, so
// every lane reads the same atoms (uniform loads), and the kernel is straight-line code: no
// loop, no branch before the final store (see encode_common.glsl for why llvmpipe needs that).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require  // [[unroll]]: core SPIR-V LoopControl
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint DIM = 64u;
layout(constant_id = 1) const uint ATOM_BLOCK = 64u;
const uint DIM_ELEMS = DIM / LANES;

layout(std430, binding = 0) readonly buffer DictElems { FELEM dict_elems[]; };
layout(std430, binding = 1) readonly buffer StateElems { FELEM state_elems[]; };
layout(std430, binding = 2) writeonly buffer Keys { uvec2 keys[]; };  // [n_vectors][n_blocks]

#include "encode_common.glsl"

void main() {
    // Addresses of the atom loads are built from push constants and constants only: that is
    // what llvmpipe recognises as uniform (nir_src_is_always_uniform; gl_WorkGroupID is not).
    // So one dispatch = one atom block of one dictionary head, workgroups over token tiles.
    uint n_blocks = (pc.n_atoms + ATOM_BLOCK - 1u) / ATOM_BLOCK;
    uint tiles_per_head = (pc.n_tok + WG_SIZE - 1u) / WG_SIZE;
    uint n_tiles = (pc.n_vectors / pc.n_tok) * tiles_per_head;
    uint wanted = pc.group0 + gl_WorkGroupID.x;
    uint tile = min(wanted, n_tiles - 1u);  // the host dispatches exact counts; belt and braces
    uint head = tile / tiles_per_head;
    uint token = (tile - head * tiles_per_head) * WG_SIZE + gl_LocalInvocationID.x;
    bool live = all(bvec2(wanted < n_tiles, token < pc.n_tok));
    uint vec_index = head * pc.n_tok + min(token, pc.n_tok - 1u);  // surplus lanes: a valid vector

    float res[DIM];
    uint r_elem = pc.res_word / LANES + vec_index * DIM_ELEMS;
    LOAD_ROW(res, state_elems, r_elem);

    uint first = pc.block * ATOM_BLOCK;
    uint atoms_elem = pc.atoms_word / LANES + (pc.dict_head * n_blocks * ATOM_BLOCK + first) * DIM_ELEMS;
    float best_c;
    ATOM_DOT(best_c, atoms_elem, 0u, res);  // atom `first` always exists
    uint best_u = 0u;
    [[unroll]] for (uint u = 1u; u < ATOM_BLOCK; ++u) {
        float c;
        ATOM_DOT(c, atoms_elem, u, res);
        // Padding atoms (zeros past n_atoms) are never taken.
        bool take = all(bvec2(corr_beats(c, best_c), first + u < pc.n_atoms));
        best_c = mix(best_c, c, take);
        best_u = mix(best_u, u, take);
        // A barrier every few atoms cuts the straight-line body into pieces for llvmpipe's
        // code generator (compile time grows ~quadratically with one piece's size).
        if ((u & 3u) == 3u)
            barrier();
    }
    if (live)
        keys[vec_index * n_blocks + pc.block] = uvec2(floatBitsToUint(best_c), first + best_u);
}
