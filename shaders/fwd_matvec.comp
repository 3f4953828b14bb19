#version 450
// y = W x' (+ y where accumulate), x' = x as matvec.glsl's X_MODE reads it: the O projection
// (added to the residual), the MLP's gate and up (x' the normed residual), its down projection
// (x' = SwiGLU of the gate and up, added to the residual) and the LM head (x' the final norm).
// W in any of weights.glsl's formats. A batch of n_seqs sequences: sequence s's x at x_word +
// s · x_seq_words, its y at y_word + s · y_seq_words, the sequences strided over by the
// workgroups' rows (gl_WorkGroupID.y), so each reads the weights from the same places at once.
// (kvdict_vk.vk.forward.)
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Weights { uint w_words[]; };
layout(std430, binding = 1) readonly buffer X { float x_vals[]; };
layout(std430, binding = 2) buffer Y { float y_vals[]; };

// Sequences a workgroup makes its rows for at once, each weight chunk decoded once for all of
// them (their x' read from memory); 1: a sequence a workgroup row, the normed x' staged.
layout(constant_id = 3) const uint SEQ_TILE = 1u;
#define MATVEC_SEQ_TILE SEQ_TILE
#include "matvec.glsl"

layout(push_constant) uniform MatvecPush {
    uint w_word;      // row r at w_word + r · (n_cols / 32) · BLOCK_WORDS
    uint x_word;
    uint y_word;
    uint n_rows;
    uint n_cols;      // a multiple of 32
    uint accumulate;  // 1: y += W x' (a residual), 0: y = W x'
    uint norm_word;   // X_RMS_NORM: the norm's weights
    uint n_seqs;
    uint x_seq_words;
    uint y_seq_words;
    float eps;        // X_RMS_NORM
} pc;

void main() {
    uint lid = row_lid(), lane = lid % ROW_THREADS;
    if (SEQ_TILE == 1u) {
        for (uint seq = gl_WorkGroupID.y; seq < pc.n_seqs; seq += gl_NumWorkGroups.y) {
            uint x_word = pc.x_word + seq * pc.x_seq_words, y_word = pc.y_word + seq * pc.y_seq_words;
            float scale = x_prepare(x_word, pc.n_cols, pc.eps, pc.norm_word);
            for (uint r0 = gl_WorkGroupID.x * ROWS; r0 < pc.n_rows; r0 += gl_NumWorkGroups.x * ROWS) {
                uint r = r0 + lid / ROW_THREADS;
                bool valid = r < pc.n_rows;
                float total = row_dot(pc.w_word, r, valid, x_word, pc.n_cols, scale, pc.norm_word);
                if (valid && lane == 0u)
                    y_vals[y_word + r] = (pc.accumulate != 0u ? y_vals[y_word + r] : 0.0) + total;
            }
            barrier();  // x_sh read before the next sequence's x is staged
        }
        return;
    }
    for (uint s0 = gl_WorkGroupID.y * SEQ_TILE; s0 < pc.n_seqs; s0 += gl_NumWorkGroups.y * SEQ_TILE) {
        uint tile = min(SEQ_TILE, pc.n_seqs - s0);  // uniform: x_prepare's barriers
        float scale[SEQ_TILE];
        for (uint t = 0u; t < tile; ++t)
            scale[t] = x_prepare(pc.x_word + (s0 + t) * pc.x_seq_words, pc.n_cols, pc.eps, pc.norm_word);
        for (uint r0 = gl_WorkGroupID.x * ROWS; r0 < pc.n_rows; r0 += gl_NumWorkGroups.x * ROWS) {
            uint r = r0 + lid / ROW_THREADS;
            bool valid = r < pc.n_rows;
            float acc[SEQ_TILE];
            row_dots(pc.w_word, r, valid, pc.x_word + s0 * pc.x_seq_words, pc.x_seq_words, tile, pc.n_cols,
                     pc.norm_word, acc);
            for (uint t = 0u; t < tile; ++t) {
                float total = row_sum(acc[t]) * scale[t];
                uint y = pc.y_word + (s0 + t) * pc.y_seq_words + r;
                if (valid && lane == 0u)
                    y_vals[y] = (pc.accumulate != 0u ? y_vals[y] : 0.0) + total;
            }
        }
    }
}
