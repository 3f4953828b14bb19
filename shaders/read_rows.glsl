// Shared by the passthrough reads (copy_rows.comp, read_rows_f16.comp, read_rows_q8.comp; host
// side kvdict_vk.layout.COPY_ROWS_PUSH): the push block and the row indexing. A read returns
// rows (h, t0 .. t0+n_tok) of one stream: output row r is token t0 + (r mod n_tok) of KV head
// r / n_tok, stored as row h*n_ctx + token of the stream's region (from src_word, its rows
// the shader's row size apart). Include after common.glsl.

layout(push_constant) uniform CopyRowsPush {
    uint src_word;  // start of the stream's passthrough region
    uint n_ctx;
    uint t0;
    uint n_tok;
    uint n_rows;    // n_kv * n_tok
    uint out_word;  // copy_rows: a multiple of LANES; read_rows_f16: even; read_rows_q8: a multiple of 4
} pc;

// The stored row (head * n_ctx + token) of output row `row`.
uint stored_row(uint row) {
    uint head = row / pc.n_tok;
    uint token = pc.t0 + (row - head * pc.n_tok);
    return head * pc.n_ctx + token;
}
