#version 450
// Decode attention, last pass of the flash paths (attend_flash*.comp): merges the splits'
// records into the output like attend_merge.comp, shaped for GPUs — ONE WORKGROUP per query
// head h, invocations across (split lane, quad c):
//   M = max_i m_i,  L = sum_i exp(m_i - M) * l_i,
//   out[h, c] = mean[g', c] + sum_i exp(m_i - M) * acc_i[c] / L
// Each split lane merges its records online (FlashAttention's running rescale), UNROLL of
// them loaded together, so the whole pass is ONE round trip to memory at up to
// SPLIT_LANES * UNROLL splits and one barrier; the lanes' (m, l, acc) then meet in shared
// memory. (Its predecessor took the maximum first — a load round, a tree of barriers — then
// loaded the records again, and was slower: lab/NOTEBOOK.md, "attend_flash: short contexts, the
// merge and the split's end".)
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

const uint LOCAL = gl_WorkGroupSize.x;  // a multiple of Q4 (host)
const uint SPLIT_LANES = LOCAL / Q4;
const uint UNROLL = 4u;  // records per split lane loaded together (8 was slower after long attend passes)

layout(std430, binding = 3) writeonly buffer Out { vec4 out_quads[]; };

layout(push_constant) uniform AttendMergeHeadPush {
    uint n_kv;
    uint n_splits;   // records per (KV head, query head)
    uint use_mean;   // 1: add the V dictionary's mean
    uint mean_word;  // a multiple of 4
    uint head_vec;   // words between two KV heads' means (0: shared dictionary)
    uint seq_heads;  // KV heads of a sequence: n_kv counts virtual heads (attend_common.glsl)
    uint out_word;   // where the output starts in Out, a multiple of 4 (a recorded step's layers share one)
} pc;

#include "attend_merge.glsl"

shared float m_sh[SPLIT_LANES];
shared float l_sh[SPLIT_LANES];
shared vec4 acc_sh[LOCAL];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint c = tid % Q4, lane = tid / Q4;
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv * GROUP; h += gl_NumWorkGroups.x) {
        uint g = h / GROUP;
        uint hj = h - g * GROUP;
        // the mean's quad, loaded beside the records (only the first lane uses it)
        vec4 mean = vec4(0.0);
        if (lane == 0u)
            mean = mean_quad(g % pc.seq_heads, c);
        // this lane's records i = lane + k * SPLIT_LANES, merged online: (m, l, o) is the
        // merge of those seen so far, referred to m (-inf while all were empty splits)
        float m = NEG_INF, l = 0.0;
        vec4 o = vec4(0.0);
        for (uint i0 = lane; i0 < pc.n_splits; i0 += SPLIT_LANES * UNROLL) {
            float mi[UNROLL], li[UNROLL];
            vec4 ai[UNROLL];
            [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                uint i = i0 + u * SPLIT_LANES;
                mi[u] = NEG_INF;
                li[u] = 0.0;
                ai[u] = vec4(0.0);
                if (i < pc.n_splits) {
                    uint rec = record(i, g, pc.n_kv) + hj;
                    mi[u] = stats[rec * 2u];  // -inf for an empty split
                    li[u] = stats[rec * 2u + 1u];
                    ai[u] = accs[rec * Q4 + c];
                }
            }
            float m_new = m;
            [[unroll]] for (uint u = 0u; u < UNROLL; ++u)
                m_new = max(m_new, mi[u]);
            if (m_new > NEG_INF) {  // else every record so far is an empty split: nothing to add
                float f = exp(m - m_new);  // 0 while m = -inf
                l *= f;
                o *= f;
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u)
                    merge_add(exp(mi[u] - m_new), li[u], ai[u], l, o);  // factor 0 for an empty split
                m = m_new;
            }
        }
        if (c == 0u) {
            m_sh[lane] = m;
            l_sh[lane] = l;
        }
        acc_sh[tid] = o;
        barrier();
        if (lane == 0u) {
            float big_m = NEG_INF;
            [[unroll]] for (uint ln = 0u; ln < SPLIT_LANES; ++ln)
                big_m = max(big_m, m_sh[ln]);
            float big_l = 0.0;
            vec4 sum = vec4(0.0);
            [[unroll]] for (uint ln = 0u; ln < SPLIT_LANES; ++ln) {
                float f = m_sh[ln] > NEG_INF ? exp(m_sh[ln] - big_m) : 0.0;  // a lane of empty splits adds nothing
                merge_add(f, l_sh[ln], acc_sh[ln * Q4 + c], big_l, sum);
            }
            out_quads[pc.out_word / 4u + h * Q4 + c] = mean + sum * (1.0 / big_l);
        }
        barrier();  // shared memory is reused by the next head
    }
}
