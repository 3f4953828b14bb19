#version 450
// Decode attention over dict-coded values, the pass between attend_flash_coded.comp and
// attend_merge_head.comp: the splits' atom weights times the V atoms, once per attention
// instead of once per split. One workgroup per (KV head g, block of HB query heads, chunk of
// CHUNK atoms):
//   M_h = max_i m_i,h                       (the splits' references, from their records)
//   W[h, a] = sum_i exp(m_i,h - M_h) w_i[h, a]   (each split's weights, from `weights`)
//   part[h] = sum_{a in chunk} W[h, a] atom[g', a]
// written as one more record per chunk — record (n_splits + chunk, g, h) with m = M_h, l = 0 —
// which attend_merge_head adds like any split's (factor exp(M_h - M) = the others' own).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(constant_id = 4) const uint N_ATOMS = 1024u;  // atoms per dictionary head
const uint LOCAL = gl_WorkGroupSize.x;  // a multiple of Q4 (host)
const uint ALANES = LOCAL / Q4;         // atom lanes of the product
const uint MAX_HB = 4u;
const uint MAX_SPLITS = 256u;           // records per (KV head, head) the factors hold (host-checked)

layout(std430, binding = 0) readonly buffer LayerQuads { uvec4 layer_quads[]; };  // V atoms
layout(std430, binding = 1) readonly buffer Weights { float weights[]; };  // [rec*N_ATOMS + a]
layout(std430, binding = 2) buffer Stats { float stats[]; };
layout(std430, binding = 3) writeonly buffer Accs { vec4 accs[]; };

layout(push_constant) uniform AttendCodedAtomsPush {
    uint n_kv;
    uint n_splits;    // the attend_flash_coded splits; the chunks' records follow them
    uint atoms_word;  // V atoms (KV head g's at + g*head_atoms), a multiple of 4
    uint head_atoms;
    uint chunk;       // atoms per chunk
} pc;

shared float f_sh[MAX_HB * MAX_SPLITS];  // exp(m_i - M) per head and split
shared float w_sh[MAX_HB * LOCAL];       // W of the chunk (chunk <= LOCAL, host); the end's sums
shared float m_sh[MAX_HB];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    uint n_chunks = (N_ATOMS + pc.chunk - 1u) / pc.chunk;
    uint items = pc.n_kv * N_HB * n_chunks;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint c = item % n_chunks;
        uint blk = (item / n_chunks) % N_HB;
        uint g = item / (n_chunks * N_HB);
        uint a0 = c * pc.chunk, n_a = min(pc.chunk, N_ATOMS - a0);
        // the references: each head's largest split maximum (one invocation per head: a few
        // hundred loads at most, all in flight)
        if (tid < HB) {
            float mx = NEG_INF;
            for (uint i = 0u; i < pc.n_splits; ++i)
                mx = max(mx, stats[(record(i, g, pc.n_kv) + blk * HB + tid) * 2u]);
            m_sh[tid] = mx;
        }
        barrier();
        for (uint x = tid; x < HB * pc.n_splits; x += LOCAL) {
            uint h = x / pc.n_splits, i = x - h * pc.n_splits;
            float m = stats[(record(i, g, pc.n_kv) + blk * HB + h) * 2u];
            f_sh[h * MAX_SPLITS + i] = m > NEG_INF ? exp(m - m_sh[h]) : 0.0;  // an empty split adds nothing
        }
        barrier();
        // the chunk's weights over the splits: an invocation per (head, atom), loads coalesced
        for (uint x = tid; x < HB * n_a; x += LOCAL) {
            uint h = x / n_a, a = x - h * n_a;
            float w = 0.0;
            for (uint i = 0u; i < pc.n_splits; ++i)
                w += f_sh[h * MAX_SPLITS + i] * weights[(record(i, g, pc.n_kv) + blk * HB + h) * N_ATOMS + a0 + a];
            w_sh[h * LOCAL + a] = w;
        }
        barrier();
        // the product: quad q4 of the chunk's atoms taken by atom lane al
        const uint q4 = tid % Q4, al = tid / Q4;
        vec4 part[MAX_HB];
        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
            part[h] = vec4(0.0);
        uint atoms = (pc.atoms_word + g * pc.head_atoms) / 4u + q4;
        for (uint a = al; a < n_a; a += ALANES) {
            vec4 av = uintBitsToFloat(layer_quads[atoms + (a0 + a) * Q4]);
            [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                if (h < HB)
                    part[h] += w_sh[h * LOCAL + a] * av;
        }
        uint rec = record(pc.n_splits + c, g, pc.n_kv) + blk * HB;
        [[unroll]] for (uint k = 0u; k < 4u; ++k) {
            barrier();
            [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                if (h < HB)
                    w_sh[h * LOCAL + tid] = part[h][k];
            barrier();
            for (uint x = tid; x < HB * Q4; x += LOCAL) {
                uint h = x / Q4, q = x - h * Q4;
                float s = 0.0;
                for (uint l = 0u; l < ALANES; ++l)
                    s += w_sh[h * LOCAL + l * Q4 + q];
                accs[(rec + h) * Q4 + q][k] = s;
            }
        }
        if (tid < HB) {
            stats[(rec + tid) * 2u] = m_sh[tid];
            stats[(rec + tid) * 2u + 1u] = 0.0;
        }
        barrier();  // shared memory is reused by the next item
    }
}
