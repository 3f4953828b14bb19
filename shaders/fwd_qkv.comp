#version 450
// A layer's Q, K and V projections in one dispatch over the normed residual (matvec.glsl's
// X_RMS_NORM), their rows W's first q_rows (the queries), k_rows (the keys) and the rest (the
// values), with RoPE applied to the query and key rows as they are written: adjacent rows
// (2i, 2i + 1) of a head, i below rope_dim / 2, rotated by the angles of the position at word
// pos_word of the step's values, from a table the host made as
// kvdict_vk.forge.llama.rope_cos_sin makes it (row p: rope_dim / 2 cosines, then the sines).
// The queries go to y_word of Y (a decode step's query block), the keys and values to k_word and
// v_word of Rows (its source rows). ROW_THREADS ≤ WG_SIZE / 2: a pair's rows in one workgroup.
// row_words > 0 (DecodeStep.row_append; over f16 or f32 rows first): the keys and values go
// straight into the layer's rows instead, at the token's row (the position: row (g, p) at
// k_layer_word + (g · n_ctx + p) · row_words, docs/ARENA.md) — binary16 pairs made as
// append_step makes them (rows_encode.glsl's f16_bits: NumPy's bits) or float32 words — so the
// decode step records no append_step for the layer and its source rows stay unwritten. Over q8_0
// rows (FORMAT_Q8_0) a block's 32 elements come from several workgroups: each writes its rows to
// the source rows as without row_words and counts them in an arrival word of its pair of blocks
// (Rows at arrival_word: one a (stream, KV head, pair), zero between dispatches); the workgroup
// whose rows complete a pair reads the pair back and stores its words (rows_encode.glsl's
// q8_pair_words, as append_step does) and sets the word to zero again. Over a KIVI layer
// (QKV_KIVI) the same with a KV head's K and V rows as the unit: the workgroup that completes
// them appends the head's token (kivi_append.glsl, as append_kivi does: its rings, a group
// leaving the window quantised, the state word).
// A batch of n_seqs sequences (row_words 0 only): sequence s's residual at x_word + s · n_cols,
// its position at pos_word + s, its queries at y_word + s · q_rows, its K and V rows at k_word
// and v_word + s · k_rows — a decode step's buffers for a batch (DecodeStep) —, the sequences
// strided over by the workgroups' rows (gl_WorkGroupID.y), SEQ_TILE of them a workgroup at once.
// k_pre_word > 0 (a layer whose keys are coded before RoPE, kvdict_vk.rope): the keys are also
// written unturned there — what the step's GPU encoder codes; the turned ones at k_word are the
// exact window's.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#define Q8_PAIR_ENCODER
#include "rows_encode.glsl"
#include "kivi.glsl"

#define QKV_KIVI 3u  // row_format of a KIVI layer (kvdict_vk.rows.QKV_FORMATS)
// a KIVI layer's (QKV_KIVI): head_dim (= the push's) and its bits (kvdict_vk.kivi.KiviSpec)
layout(constant_id = 3) const uint HEAD_DIM = 64u;
layout(constant_id = 4) const uint K_BITS = 4u;
layout(constant_id = 5) const uint V_BITS = 4u;
// Sequences of a batch a workgroup makes its rows for at once, each weight chunk decoded once for
// all of them (their x' read from memory, not staged; no fused append: a batch has none)
layout(constant_id = 6) const uint SEQ_TILE = 1u;
#define MATVEC_SEQ_TILE SEQ_TILE

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Weights { uint w_words[]; };
layout(std430, binding = 1) readonly buffer X { float x_vals[]; };
layout(std430, binding = 2) writeonly buffer Y { float y_vals[]; };
// coherent: a q8_0 pair's or KIVI head's rows are read back by the workgroup that arrives last
layout(std430, binding = 3) coherent buffer Rows { uint kv_words[]; };
layout(std430, binding = 4) readonly buffer Table { float table_vals[]; };
layout(std430, binding = 5) readonly buffer Values { uint value_words[]; };
// coherent: a KIVI group is read back from the rings just written
layout(std430, binding = 6) coherent buffer Layer { uint layer_words[]; };

#include "matvec.glsl"

layout(push_constant) uniform QkvPush {
    uint w_word;
    uint x_word;
    uint n_cols;
    uint q_rows;     // n_heads · head_dim
    uint k_rows;     // n_kv · head_dim; as many value rows follow
    uint y_word;
    uint k_word;
    uint v_word;
    uint head_dim;
    uint rope_dim;
    uint pos_word;
    uint n_pos;      // the table's positions: a position past it reads the last
    uint norm_word;
    uint row_words;      // words a stored row holds; 0: the rows go to Rows only
    uint row_format;     // FORMAT_F16, FORMAT_WORDS (f32 rows), FORMAT_Q8_0 or QKV_KIVI
    uint k_layer_word;   // the layer's K and V regions in Layer
    uint v_layer_word;
    uint n_ctx;          // rows a KV head
    uint k_pre_word;     // > 0: the keys before RoPE too, in Rows
    uint arrival_word;   // FORMAT_Q8_0, QKV_KIVI: the arrival words in Rows
    uint stats_word;     // QKV_KIVI: kivi_append.glsl's KiviLayer (its K and V regions:
    uint k_window_word;  // k_layer_word, v_layer_word)
    uint v_window_word;
    uint recent;
    uint state_word;
    uint n_seqs;
    float eps;
} pc;

float kivi_source(bool key, uint h, uint e) {
    return uintBitsToFloat(kv_words[(key ? pc.k_word : pc.v_word) + h * pc.head_dim + e]);
}

// kivi_append.glsl's stage: matvec.glsl's x_sh (2 048 words: HEAD_DIM ≤ 128, host-checked;
// the normed x is staged again where the workgroup has rows left)
#define KIVI_STAGE_GET(i) x_sh[(i) >> 2u][(i) & 3u]
#define KIVI_STAGE_SET(i, w) x_sh[(i) >> 2u][(i) & 3u] = (w)
#include "kivi_append.glsl"

shared float row_vals[ROWS];
shared float out_vals[ROWS];  // the rows as written (after RoPE): a binary16 pair's two halves
// FORMAT_Q8_0, QKV_KIVI: an iteration's rows in pieces of up to 32 (each within one pair of blocks
// and one KV head: q_rows, k_rows and head_dim are multiples of 32, host-checked), the unit (a
// pair, a KV head) a piece completed or NONE
const uint PIECES = (ROWS + 31u) / 32u;
const uint NONE = 0xFFFFFFFFu;
shared uint completed[PIECES];

// Pair `pair` of the K (stream 0) or V rows, as the source rows hold it, into the layer's row
// at position p (the whole workgroup).
void store_q8_pair(uint pair, uint p) {
    uint lid = gl_LocalInvocationID.x, pairs = (pc.head_dim + 63u) / 64u, n_blocks = pc.head_dim / 32u;
    uint head = pair / pairs, pp = pair - head * pairs;  // head: stream · n_kv + KV head
    uint n_kv = pc.k_rows / pc.head_dim, stream = head / n_kv, g = head - stream * n_kv;
    uint d = 64u * pp + lid;
    bool real = lid < 64u && d < pc.head_dim;
    uint src = (stream == 0u ? pc.k_word : pc.v_word) + g * pc.head_dim + d;
    uint scale_word, value_word;
    q8_pair_words(real ? uintBitsToFloat(kv_words[src]) : 0.0, real, 2u * pp + 1u < n_blocks, scale_word, value_word);
    uint row = (stream == 0u ? pc.k_layer_word : pc.v_layer_word) + (g * pc.n_ctx + p) * pc.row_words;
    if (lid == 0u)
        layer_words[row + pp] = scale_word;
    if (lid < 16u && 4u * lid < pc.head_dim - 64u * pp)
        layer_words[row + (n_blocks + 1u) / 2u + 16u * pp + lid] = value_word;
}

// Row r's value as written: its total, or where it is a query's or key's element below rope_dim,
// turned with its pair's (even, odd) totals by position p's angles.
float roped(uint r, uint p, float total, float even, float odd) {
    uint d = (r < pc.q_rows ? r : r - pc.q_rows) % pc.head_dim;
    if (r >= pc.q_rows + pc.k_rows || d >= pc.rope_dim)
        return total;
    uint i = d / 2u;
    float c = table_vals[p * pc.rope_dim + i], s = table_vals[p * pc.rope_dim + pc.rope_dim / 2u + i];
    precise float rotated = (d & 1u) == 0u ? even * c - odd * s : even * s + odd * c;
    return rotated;
}

// Sequence seq's row r, v as written (total before RoPE), into its query or its K or V source row
// (a key coded before RoPE: also unturned at k_pre_word).
void store_row(uint seq, uint r, float v, float total) {
    if (r < pc.q_rows) {
        y_vals[pc.y_word + seq * pc.q_rows + r] = v;
        return;
    }
    uint within = r - pc.q_rows;  // the row in the K and V rows
    if (within < pc.k_rows) {
        kv_words[pc.k_word + seq * pc.k_rows + within] = floatBitsToUint(v);
        if (pc.k_pre_word != 0u)
            kv_words[pc.k_pre_word + seq * pc.k_rows + within] = floatBitsToUint(total);
    } else {
        kv_words[pc.v_word + seq * pc.k_rows + within - pc.k_rows] = floatBitsToUint(v);
    }
}

// Sequence seq's rows (its residual, position, queries and K/V rows as the header says).
void project(uint seq) {
    uint lid = row_lid(), slot = lid / ROW_THREADS;
    uint n_rows = pc.q_rows + 2u * pc.k_rows;
    uint x_word = pc.x_word + seq * pc.n_cols;
    float scale = x_prepare(x_word, pc.n_cols, pc.eps, pc.norm_word);
    uint p = min(value_words[pc.pos_word + seq], pc.n_pos - 1u);
    bool q8 = pc.row_words != 0u && pc.row_format == FORMAT_Q8_0;
    bool kivi = pc.row_words != 0u && pc.row_format == QKV_KIVI;
    bool in_layer = pc.row_words != 0u && !q8 && !kivi;  // rows written into the layer here, element by element
    for (uint r0 = gl_WorkGroupID.x * ROWS; r0 < n_rows; r0 += gl_NumWorkGroups.x * ROWS) {
        uint r = r0 + slot;
        bool valid = r < n_rows;
        float total = row_dot(pc.w_word, r, valid, x_word, pc.n_cols, scale, pc.norm_word);
        if (lid % ROW_THREADS == 0u)
            row_vals[slot] = total;
        barrier();
        if (valid && lid % ROW_THREADS == 0u) {
            float v = roped(r, p, total, row_vals[slot & ~1u], row_vals[slot | 1u]);
            if (in_layer && r >= pc.q_rows)
                out_vals[slot] = v;
            else
                store_row(seq, r, v, total);
        }
        if (q8 || kivi) {
            memoryBarrierBuffer();  // this invocation's source words before its workgroup's arrivals
            barrier();
            uint lid0 = gl_LocalInvocationID.x;
            if (lid0 < PIECES) {
                uint a = r0 + 32u * lid0, b = min(min(r0 + ROWS, a + 32u), n_rows);
                completed[lid0] = NONE;
                if (a >= pc.q_rows && a < b) {
                    uint within = a - pc.q_rows, stream = within / pc.k_rows, e = within - stream * pc.k_rows;
                    uint pairs = (pc.head_dim + 63u) / 64u, g = e / pc.head_dim, pp = (e % pc.head_dim) / 64u;
                    // the unit and its rows: a pair of blocks of a stream's KV head; a KV head's K and V
                    uint unit = kivi ? g : (stream * (pc.k_rows / pc.head_dim) + g) * pairs + pp;
                    uint unit_rows = kivi ? 2u * pc.head_dim : min(64u, pc.head_dim - 64u * pp);
                    uint arrived = atomicAdd(kv_words[pc.arrival_word + unit], b - a) + (b - a);
                    if (arrived == unit_rows) {
                        atomicExchange(kv_words[pc.arrival_word + unit], 0u);  // for the next dispatch
                        completed[lid0] = unit;
                    }
                }
            }
            memoryBarrierBuffer();
            barrier();
            KiviLayer layer = KiviLayer(pc.k_layer_word, pc.v_layer_word, pc.stats_word, pc.k_window_word,
                                        pc.v_window_word, pc.recent, pc.state_word, pc.n_ctx);
            bool staged = false;  // x_sh holds a KIVI group
            [[unroll]] for (uint i = 0u; i < PIECES; ++i) {
                if (completed[i] != NONE) {  // uniform: the workgroup's shared word
                    if (kivi)
                        staged = kivi_append_head(layer, completed[i], p + 1u) || staged;
                    else
                        store_q8_pair(completed[i], p);
                }
            }
            if (staged && r0 + gl_NumWorkGroups.x * ROWS < n_rows)
                scale = x_prepare(x_word, pc.n_cols, pc.eps, pc.norm_word);
        }
        if (in_layer) {
            barrier();  // out_vals holds both rows of a pair
            if (valid && lid % ROW_THREADS == 0u && r >= pc.q_rows) {
                uint within = r - pc.q_rows;
                bool key = within < pc.k_rows;
                uint e = key ? within : within - pc.k_rows;  // (KV head g, element d) of the stream
                uint g = e / pc.head_dim, d = e % pc.head_dim;
                uint row = (key ? pc.k_layer_word : pc.v_layer_word) + (g * pc.n_ctx + p) * pc.row_words;
                if (pc.row_format == FORMAT_F16 && (d & 1u) == 0u)
                    layer_words[row + d / 2u] = f16_bits(out_vals[slot]) | (f16_bits(out_vals[slot + 1u]) << 16u);
                else if (pc.row_format == FORMAT_WORDS)
                    layer_words[row + d] = floatBitsToUint(out_vals[slot]);
            }
        }
        barrier();  // row_vals and out_vals read before the next rows overwrite them
    }
}

shared float tile_vals[ROWS * SEQ_TILE];  // project_tile's rows' totals, a sequence's after another's

// Sequences s0 .. s0 + tile − 1's rows (tile ≤ SEQ_TILE), as project makes each one's.
void project_tile(uint s0, uint tile) {
    uint lid = row_lid(), slot = lid / ROW_THREADS, lane = lid % ROW_THREADS;
    uint n_rows = pc.q_rows + 2u * pc.k_rows;
    float scale[SEQ_TILE];
    for (uint t = 0u; t < tile; ++t)  // uniform: x_prepare's barriers
        scale[t] = x_prepare(pc.x_word + (s0 + t) * pc.n_cols, pc.n_cols, pc.eps, pc.norm_word);
    for (uint r0 = gl_WorkGroupID.x * ROWS; r0 < n_rows; r0 += gl_NumWorkGroups.x * ROWS) {
        uint r = r0 + slot;
        bool valid = r < n_rows;
        float acc[SEQ_TILE];
        row_dots(pc.w_word, r, valid, pc.x_word + s0 * pc.n_cols, pc.n_cols, tile, pc.n_cols, pc.norm_word, acc);
        for (uint t = 0u; t < tile; ++t) {
            float total = row_sum(acc[t]) * scale[t];
            if (lane == 0u)
                tile_vals[t * ROWS + slot] = total;
        }
        barrier();
        if (valid && lane == 0u) {
            for (uint t = 0u; t < tile; ++t) {
                uint seq = s0 + t, p = min(value_words[pc.pos_word + seq], pc.n_pos - 1u), at = t * ROWS;
                float total = tile_vals[at + slot];
                store_row(seq, r, roped(r, p, total, tile_vals[at + (slot & ~1u)], tile_vals[at + (slot | 1u)]), total);
            }
        }
        barrier();  // tile_vals read before the next rows overwrite them
    }
}

void main() {
    if (SEQ_TILE == 1u) {
        for (uint seq = gl_WorkGroupID.y; seq < pc.n_seqs; seq += gl_NumWorkGroups.y)
            project(seq);
        return;
    }
    for (uint s0 = gl_WorkGroupID.y * SEQ_TILE; s0 < pc.n_seqs; s0 += gl_NumWorkGroups.y * SEQ_TILE)
        project_tile(s0, min(SEQ_TILE, pc.n_seqs - s0));
}
