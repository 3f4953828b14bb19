#version 450
// The index of the largest of n floats (the first of equals, as numpy.argmax; NaN never
// wins): greedy decoding's next token, in two dispatches. Stage 0: part p of `parts` (a
// workgroup each, grid stride) reduces its span of x to (value bits, index) at partial
// word 2p; stage 1: one workgroup reduces the parts and writes the index at the state's
// out_word. (One workgroup over a whole vocabulary would wait on its loads one after another.)
// A batch: sequence s's floats at x_word + s · n, its parts at partial word 2 · parts · s, its
// index at out_word + s.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer X { float x_vals[]; };
layout(std430, binding = 1) buffer Partial { uint partial_words[]; };
layout(std430, binding = 2) writeonly buffer State { uint state_words[]; };

layout(push_constant) uniform ArgmaxPush {
    uint x_word;
    uint n;
    uint out_word;
    uint parts;
    uint stage;
    uint n_seqs;
} pc;

shared float best_val[WG_SIZE];
shared uint best_idx[WG_SIZE];

bool better(float v, uint i, float bv, uint bi) { return v > bv || (v == bv && i < bi); }

// The workgroup's best of what each invocation brought; in best_val[0], best_idx[0].
void reduce(float bv, uint bi) {
    uint lid = gl_LocalInvocationID.x;
    best_val[lid] = bv;
    best_idx[lid] = bi;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (lid < s && better(best_val[lid + s], best_idx[lid + s], best_val[lid], best_idx[lid])) {
            best_val[lid] = best_val[lid + s];
            best_idx[lid] = best_idx[lid + s];
        }
        barrier();
    }
}

void main() {
    uint lid = gl_LocalInvocationID.x;
    const float NO_VALUE = uintBitsToFloat(0xFF800000u);  // -inf, with index past every other
    for (uint seq = gl_WorkGroupID.y; seq < pc.n_seqs; seq += gl_NumWorkGroups.y) {
        uint x_word = pc.x_word + seq * pc.n, part_word = 2u * pc.parts * seq;
        if (pc.stage == 0u) {
            uint span = (pc.n + pc.parts - 1u) / pc.parts;
            for (uint p = gl_WorkGroupID.x; p < pc.parts; p += gl_NumWorkGroups.x) {
                float bv = NO_VALUE;
                uint bi = 0xFFFFFFFFu;
                for (uint i = p * span + lid; i < min(pc.n, (p + 1u) * span); i += WG_SIZE) {
                    float v = x_vals[x_word + i];
                    if (better(v, i, bv, bi)) {
                        bv = v;
                        bi = i;
                    }
                }
                reduce(bv, bi);
                if (lid == 0u) {
                    partial_words[part_word + 2u * p] = floatBitsToUint(best_val[0]);
                    partial_words[part_word + 2u * p + 1u] = best_idx[0];
                }
                barrier();
            }
        } else {
            float bv = NO_VALUE;
            uint bi = 0xFFFFFFFFu;
            for (uint p = lid; p < pc.parts; p += WG_SIZE) {
                float v = uintBitsToFloat(partial_words[part_word + 2u * p]);
                uint i = partial_words[part_word + 2u * p + 1u];
                if (better(v, i, bv, bi)) {
                    bv = v;
                    bi = i;
                }
            }
            reduce(bv, bi);
            if (lid == 0u)
                state_words[pc.out_word + seq] = min(best_idx[0], pc.n - 1u);
            barrier();  // best_* read before the next sequence's reduce
        }
    }
}
