#version 450
// Decode attention over a dict-coded K stream, pass 0: the table of q . atom for every
// query head and atom, table[(g*GROUP + hj)*n_atoms + a] = q[g*GROUP + hj] . atoms[g', a]
// (g' = g with per-head dictionaries, 0 when shared: the host passes the atoms stride); with
// n_seqs sequences g runs over the virtual heads b*n_kv + g (attend_common.glsl), g' from g mod n_kv.
// A key then costs `sparsity` lookups instead of HEAD_DIM multiply-adds (attend_split.comp).
// Work items (KV head, head block, atom); each invocation takes a contiguous run of them
// (the host dispatches a few invocations per hardware thread), so the block's query heads —
// private — are reloaded only when a run crosses to another block.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
layout(constant_id = 4) const bool ATOMS_F16 = false;  // the atoms in binary16 (atoms.glsl)
#include "atoms.glsl"

layout(std430, binding = 0) readonly buffer LayerQuads { uvec4 layer_quads[]; };
layout(std430, binding = 1) readonly buffer Query { vec4 q_quads[]; };
layout(std430, binding = 2) writeonly buffer Table { float table[]; };

layout(push_constant) uniform AttendTablePush {
    uint atoms_word;  // the K stream's atoms block (a multiple of 4)
    uint head_atoms;  // words between two KV heads' atoms (0: shared dictionary)
    uint n_atoms;
    uint n_kv;
    uint n_seqs;
    uint q_word;      // where the query block starts (a multiple of 4: attend_common.glsl)
} pc;

void main() {
    uint items = pc.n_kv * pc.n_seqs * N_HB * pc.n_atoms;
    uint run = (items + grid_size() - 1u) / grid_size();
    uint first = gl_GlobalInvocationID.x * run;
    vec4 q[BQ];
    uint cached_unit = 0xFFFFFFFFu;
    for (uint item = first; item < min(first + run, items); ++item) {
        uint unit = item / pc.n_atoms;  // (KV head, head block)
        uint a = item - unit * pc.n_atoms;
        uint g = unit / N_HB;
        uint h0 = g * GROUP + (unit - g * N_HB) * HB;  // first query head of the block
        if (unit != cached_unit) {
            cached_unit = unit;
            [[unroll]] for (uint x = 0u; x < BQ; ++x)
                q[x] = q_quads[pc.q_word / 4u + h0 * Q4 + x];
        }
        uint base = (pc.atoms_word + (g % pc.n_kv) * pc.head_atoms) >> 2u;
        vec4 atom[Q4];
        LOAD_ATOM(layer_quads, base, a, atom)
        [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
            float d = 0.0;
            [[unroll]] for (uint c = 0u; c < Q4; ++c)
                d += dot(q[hj * Q4 + c], atom[c]);
            table[(h0 + hj) * pc.n_atoms + a] = d;
        }
    }
}
