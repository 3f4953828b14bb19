// Shared by the last passes of decode attention, which merge the splits' records
// (attend_common.glsl) into the output: attend_merge.comp (direct path), attend_reduce.comp
// (table path, factors from attend_combine.comp) and attend_merge_head.comp (flash paths).
// Each merges in its own order — the maximum first then the sums (attend_merge), precomputed
// factors (attend_reduce), a running rescale per split lane then across lanes
// (attend_merge_head) — and shares the buffers, the record's contribution and the mean.
//
// Include after common.glsl, attend_common.glsl and the shader's push block, which has
// use_mean, mean_word and head_vec; the output buffer (binding 3, or 4 after attend_reduce's
// blocks) stays in the shader.

layout(std430, binding = 0) readonly buffer LayerQuads { uvec4 layer_quads[]; };
layout(std430, binding = 1) readonly buffer Stats { float stats[]; };
layout(std430, binding = 2) readonly buffer Accs { vec4 accs[]; };

// The per-quad passes (attend_merge, attend_reduce) take one work item per output quad,
// n_kv * GROUP * Q4 of them: item = h * Q4 + c, query head h = g * GROUP + hj.
void quad_item(uint item, out uint h, out uint c, out uint g, out uint hj) {
    h = item / Q4;
    c = item - h * Q4;
    g = h / GROUP;
    hj = h - g * GROUP;
}

// A record's (or a merged set's) contribution at factor f — exp(m_i - M) against the merge's
// maximum M, 0 for an empty split: l += f * l_i, o += f * acc_i.
void merge_add(float f, float l_i, vec4 acc_i, inout float l, inout vec4 o) {
    l += f * l_i;
    o += f * acc_i;
}

// Quad c of the V dictionary's mean of (dictionary) KV head g, or zeros without one: the
// probabilities sum to one, so it is added once, after the merge.
vec4 mean_quad(uint g, uint c) {
    vec4 mean = vec4(0.0);
    if (pc.use_mean != 0u)
        mean = uintBitsToFloat(layer_quads[((pc.mean_word + g * pc.head_vec) >> 2u) + c]);
    return mean;
}
