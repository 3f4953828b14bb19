#version 450
// Read of a KIVI stream (kvdict_vk.kivi, docs/ARENA.md): rows (h, t0 .. t0+n_tok) as f32 —
// of one sequence (a batched arena's sequence s holds rows s·seq_ctx .. of a head; its
// statistics, ring and state word are its KIVI head's, h·(n_ctx / seq_ctx) + s, and its own).
// A token below the sequence's quantised end (its state word, written by every append, so a
// recorded read stays right as the cache grows) decodes as level * scale + min with its
// group's binary16 (scale, min) — per channel and 32-token group for keys (the statistics
// region), per 32-dim group of the token for values (the row's first words); a later token
// is read from the exact window, a ring of WINDOW binary16 rows (token t at t mod WINDOW).
// One invocation per four elements, grid-stride. The twin of kvdict_vk.kivi.cache_rows.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "kivi.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // a multiple of 32
layout(constant_id = 1) const uint BITS = 4u;       // 2 .. 8
layout(constant_id = 2) const uint KEYS = 1u;       // 1: keys (per-channel statistics), 0: values
layout(constant_id = 3) const uint GROUP = 32u;     // kvdict_vk.kivi.GROUP (tokens of a key group, dims of a value group)
const uint LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, BITS);
const uint STATS_IN_ROW = KEYS > 0u ? 0u : HEAD_DIM / GROUP;
const uint ROW_WORDS = STATS_IN_ROW + LEVEL_WORDS;
const uint QUADS = HEAD_DIM / 4u;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) writeonly buffer OutQuads { vec4 out_quads[]; };

layout(push_constant) uniform ReadKiviPush {
    uint src_word;     // the stream's rows (levels; values: their statistics first)
    uint n_ctx;
    uint t0;
    uint n_tok;
    uint n_rows;       // n_kv * n_tok
    uint out_word;     // a multiple of 4
    uint stats_word;   // keys: the group statistics, (kh * ceil(seq_ctx / 32) + group) * HEAD_DIM + channel
    uint window_word;  // the exact windows: (kh * window + t mod window) * HEAD_DIM / 2 words
    uint window;
    uint state_word;   // the sequences' quantised ends (a sequence's tokens below its own are quantised)
    uint seq_ctx;      // rows of a head a sequence holds (n_ctx: one sequence)
} pc;

// level * scale + min rounded twice, as kvdict_vk.kivi computes it (precise: no fused
// multiply-add), so a read equals the reference bit for bit
float dequantised(uint level, uint stats) {
    vec2 scale_min = kivi_scale_min(stats);
    precise float scaled = float(level) * scale_min.x;
    precise float x = scaled + scale_min.y;
    return x;
}

void main() {
    uint n = pc.n_rows * QUADS;
    uint seqs = pc.n_ctx / pc.seq_ctx;
    for (uint i = gl_GlobalInvocationID.x; i < n; i += grid_stride()) {
        uint row = i / QUADS;
        uint c = i - row * QUADS;  // elements 4c .. 4c+3
        uint head = row / pc.n_tok;
        uint token = pc.t0 + (row - head * pc.n_tok);  // the row in the head's region
        uint seq = token / pc.seq_ctx, t = token - seq * pc.seq_ctx, kh = kivi_head(head, seq, seqs);
        vec4 x;
        if (t >= layer_words[pc.state_word + seq]) {
            uint w = kivi_window_row(pc.window_word, kh, t, pc.window, HEAD_DIM) + 2u * c;
            x = vec4(unpackHalf2x16(layer_words[w]), unpackHalf2x16(layer_words[w + 1u]));
        } else {
            uint base = pc.src_word + (head * pc.n_ctx + token) * ROW_WORDS;
            uint lw = base + STATS_IN_ROW;
            for (uint k = 0u; k < 4u; ++k) {
                uint e = 4u * c + k;
                uint bit = e * BITS;
                uint level = residual_level(layer_words[lw + (bit >> 5u)],
                                            layer_words[lw + min((bit >> 5u) + 1u, LEVEL_WORDS - 1u)], bit & 31u, BITS);
                uint stats = KEYS > 0u ? layer_words[kivi_stats_row(pc.stats_word, kh, t, pc.seq_ctx, HEAD_DIM) + e]
                                       : layer_words[base + e / GROUP];
                x[k] = dequantised(level, stats);
            }
        }
        out_quads[pc.out_word / 4u + i] = x;
    }
}
