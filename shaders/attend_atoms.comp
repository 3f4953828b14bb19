#version 450
// Decode attention over a dict-coded V stream, pass 3: the atom weights of every query head
// — the splits' weights ("bins", attend_split.comp) rescaled to the head's overall maximum,
// W[hj][a] = sum_i f_i * bins_i[hj][a] (f_i from attend_combine.comp) — times the atoms:
// the one small matrix-vector product per query head that replaces per-token value
// reconstruction,
//   blocks[((g*n_blocks + b)*GROUP + hj)*Q4 + c] = sum_{a in block b} W[hj][a] * atoms[g', a, quad c]
// One invocation per (KV head g, head block, block b of ATOM_BLOCK atoms): each atom row is
// read once per head block; attend_reduce.comp adds the blocks up. Every bin read is set
// back to zero, so the next attention starts from clear bins without a clearing pass.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
layout(constant_id = 4) const bool ATOMS_F16 = false;  // the atoms in binary16 (atoms.glsl)
#include "atoms.glsl"

#define ATOM_BLOCK 16u

layout(std430, binding = 0) readonly buffer LayerQuads { uvec4 layer_quads[]; };
layout(std430, binding = 1) readonly buffer Stats { float stats[]; };
layout(std430, binding = 2) buffer Bins { float bins[]; };
layout(std430, binding = 3) writeonly buffer Blocks { vec4 blocks[]; };

layout(push_constant) uniform AttendAtomsPush {
    uint atoms_word;  // the V stream's atoms block (a multiple of 4)
    uint head_atoms;  // words between two KV heads' atoms (0: shared dictionary)
    uint n_atoms;
    uint n_kv;
    uint n_splits;
    uint f_word;      // the combine's factors in the stats buffer
} pc;

void main() {
    uint n_blocks = (pc.n_atoms + ATOM_BLOCK - 1u) / ATOM_BLOCK;
    uint items = pc.n_kv * N_HB * n_blocks;
    for (uint item = gl_GlobalInvocationID.x; item < items; item += grid_size()) {
        uint unit = item / n_blocks;
        uint b = item - unit * n_blocks;
        uint g = unit / N_HB;
        uint hj0 = (unit - g * N_HB) * HB;
        vec4 acc[BQ];
        [[unroll]] for (uint x = 0u; x < BQ; ++x)
            acc[x] = vec4(0.0);
        uint a_end = min((b + 1u) * ATOM_BLOCK, pc.n_atoms);
        for (uint a = b * ATOM_BLOCK; a < a_end; ++a) {
            float w[HB];
            [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                w[hj] = 0.0;
            [[dont_unroll]] for (uint i = 0u; i < pc.n_splits; ++i) {
                uint rec = record(i, g, pc.n_kv) + hj0;
                [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
                    uint bin = (rec + hj) * pc.n_atoms + a;
                    w[hj] += stats[pc.f_word + rec + hj] * bins[bin];
                    bins[bin] = 0.0;
                }
            }
            vec4 atom[Q4];
            LOAD_ATOM(layer_quads, (pc.atoms_word + g * pc.head_atoms) >> 2u, a, atom)
            [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                [[unroll]] for (uint c = 0u; c < Q4; ++c)
                    acc[hj * Q4 + c] += w[hj] * atom[c];
        }
        uint dst = ((g * n_blocks + b) * GROUP + hj0) * Q4;
        [[unroll]] for (uint x = 0u; x < BQ; ++x)
            blocks[dst + x] = acc[x];
    }
}
