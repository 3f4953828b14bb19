#version 450
// A recorded decode step's append (kvdict_vk.vk.arena.decode): one new token of each of
// n_seqs sequences, K and V, written at the row its n_used names — read from the query
// block the attention after it reads (attend_common.glsl's SEQ_USED word: the token's
// position + 1), so one recording serves every step. The step buffer holds at k_src_word the
// K source rows (sequence, KV head), at v_src_word the V rows: float32 rows (head_dim words)
// that this kernel turns into the stream's binary16 or q8_0 words (rows_encode.glsl: NumPy's
// bits), or the stored words themselves (FORMAT_WORDS: f32 rows, a coded stream's slots).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "rows_encode.glsl"

// a stream's source format (kvdict_vk.rows.APPEND_FORMATS)
#define FORMAT_WORDS 0u
#define FORMAT_F16 1u
#define FORMAT_Q8_0 2u

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Step { uint step_words[]; };
layout(std430, binding = 1) readonly buffer Query { uint query_words[]; };
layout(std430, binding = 2) writeonly buffer Layer { uint layer_words[]; };

layout(push_constant) uniform AppendStepPush {
    uint k_src_word;
    uint v_src_word;
    uint k_word;        // the layer's K region: n_ctx rows per KV head
    uint v_word;
    uint k_row_words;   // words a stored row holds
    uint v_row_words;
    uint n_kv;
    uint n_seqs;
    uint n_ctx;
    uint seq_rows;      // rows a sequence holds (its first is seq * seq_rows)
    uint lengths_word;  // the query block's n_used words, one per sequence
    uint k_format;      // FORMAT_*
    uint v_format;
    uint head_dim;      // floats a source row holds (FORMAT_F16, FORMAT_Q8_0)
} pc;

float src_float(uint row_word, uint i) { return uintBitsToFloat(step_words[row_word + i]); }

// The inverse scale of q8_0 block b of the row at row_word (its d alongside, as binary16 bits).
float q8_block(uint row_word, uint b, out uint d_bits) {
    float amax = 0.0;
    for (uint i = 32u * b; i < 32u * b + 32u; ++i)
        amax = max(amax, abs(src_float(row_word, i)));
    float d = div_rn(amax, 127.0);
    d_bits = f16_bits(d);
    return q8_inverse_scale(d);
}

// Word w of the stored row made from the source row at row_word.
uint row_word_of(uint format, uint row_word, uint w) {
    if (format == FORMAT_WORDS)
        return step_words[row_word + w];
    if (format == FORMAT_F16)
        return f16_bits(src_float(row_word, 2u * w)) | (f16_bits(src_float(row_word, 2u * w + 1u)) << 16u);
    uint n_blocks = pc.head_dim / 32u, scale_words = (n_blocks + 1u) / 2u;
    uint lo, hi = 0u;
    if (w < scale_words) {  // the scales of blocks 2w (low half) and 2w + 1
        q8_block(row_word, 2u * w, lo);
        if (2u * w + 1u < n_blocks)
            q8_block(row_word, 2u * w + 1u, hi);
        return lo | (hi << 16u);
    }
    uint e = 4u * (w - scale_words);  // elements e .. e + 3, element e in the low byte
    float inv = q8_block(row_word, e / 32u, lo);
    uint word = 0u;
    for (uint i = 0u; i < 4u; ++i)
        word |= (uint(q8_value(src_float(row_word, e + i), inv)) & 0xFFu) << (8u * i);
    return word;
}

void main() {
    uint k_words = pc.n_seqs * pc.n_kv * pc.k_row_words;
    uint n_words = k_words + pc.n_seqs * pc.n_kv * pc.v_row_words;
    for (uint w = gl_GlobalInvocationID.x; w < n_words; w += grid_stride()) {
        bool key = w < k_words;
        uint row_words = key ? pc.k_row_words : pc.v_row_words;
        uint format = key ? pc.k_format : pc.v_format;
        uint x = key ? w : w - k_words;
        uint row = x / row_words;  // seq * n_kv + head
        uint seq = row / pc.n_kv;
        uint head = row - seq * pc.n_kv;
        uint src_row_words = format == FORMAT_WORDS ? row_words : pc.head_dim;
        uint src = (key ? pc.k_src_word : pc.v_src_word) + row * src_row_words;
        // clamped as SEQ_USED clamps it: a bad length writes inside the sequence's rows
        uint t = clamp(query_words[pc.lengths_word + seq], 1u, pc.seq_rows) - 1u;
        uint dst = (key ? pc.k_word : pc.v_word) + (head * pc.n_ctx + seq * pc.seq_rows + t) * row_words;
        layer_words[dst + x - row * row_words] = row_word_of(format, src, x - row * row_words);
    }
}
