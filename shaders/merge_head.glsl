// One query head's split records (attend_common.glsl's layout) merged by a workgroup — the
// body of attend_merge_head.comp, and of attend_flash.comp's last split to finish a KV head
// (MERGE_LAST). Invocations across (split lane, quad c): each split lane merges its records
// online (FlashAttention's running rescale), MERGE_UNROLL of them loaded together, so a head
// takes ONE round trip to memory at up to MERGE_LANES * MERGE_UNROLL splits and one barrier;
// the lanes' (m, l, acc) then meet in shared memory:
//   M = max_i m_i,  L = sum_i exp(m_i - M) * l_i,  out[c] = sum_i exp(m_i - M) * acc_i[c] / L
// (Its predecessor took the maximum first — a load round, a tree of barriers — then loaded the
// records again, and was slower: lab/NOTEBOOK.md, "attend_flash: short contexts, the merge and
// the split's end".)
//
// The includer has LOCAL (a multiple of Q4), its float stats[] (record rec's m, l at 2 rec,
// 2 rec + 1) and MERGE_ACC(rec, c), quad c of record rec's accumulator.

const uint MERGE_LANES = LOCAL >= Q4 ? LOCAL / Q4 : 1u;  // LOCAL < Q4: never merges (host-checked)
const uint MERGE_UNROLL = 4u;  // records per split lane loaded together (8 was slower after long attend passes)

shared float merge_m_sh[MERGE_LANES];
shared float merge_l_sh[MERGE_LANES];
shared vec4 merge_acc_sh[LOCAL];

// Quad c = tid of query head hj of virtual head g merged over records i < n_splits (record(i,
// g, n_vheads) + hj): returned in split lane 0 (tid < Q4), garbage elsewhere. Every invocation
// of the workgroup calls it (its barriers); shared memory is free again when it returns.
vec4 merge_head(uint g, uint hj, uint n_splits, uint n_vheads, uint tid) {
    const uint c = tid % Q4, lane = tid / Q4;
    // this lane's records i = lane + k * MERGE_LANES, merged online: (m, l, o) is the merge of
    // those seen so far, referred to m (-inf while all were empty splits)
    float m = NEG_INF, l = 0.0;
    vec4 o = vec4(0.0);
    for (uint i0 = lane; i0 < n_splits; i0 += MERGE_LANES * MERGE_UNROLL) {
        float mi[MERGE_UNROLL], li[MERGE_UNROLL];
        vec4 ai[MERGE_UNROLL];
        [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; ++u) {
            uint i = i0 + u * MERGE_LANES;
            mi[u] = NEG_INF;
            li[u] = 0.0;
            ai[u] = vec4(0.0);
            if (i < n_splits) {
                uint rec = record(i, g, n_vheads) + hj;
                mi[u] = stats[rec * 2u];  // -inf for an empty split
                li[u] = stats[rec * 2u + 1u];
                ai[u] = MERGE_ACC(rec, c);
            }
        }
        float m_new = m;
        [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; ++u)
            m_new = max(m_new, mi[u]);
        if (m_new > NEG_INF) {  // else every record so far is an empty split: nothing to add
            float f = exp(m - m_new);  // 0 while m = -inf
            l *= f;
            o *= f;
            [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; ++u)
                merge_add(exp(mi[u] - m_new), li[u], ai[u], l, o);  // factor 0 for an empty split
            m = m_new;
        }
    }
    if (c == 0u) {
        merge_m_sh[lane] = m;
        merge_l_sh[lane] = l;
    }
    merge_acc_sh[tid] = o;
    barrier();
    vec4 sum = vec4(0.0);
    if (lane == 0u) {
        float big_m = NEG_INF;
        [[unroll]] for (uint ln = 0u; ln < MERGE_LANES; ++ln)
            big_m = max(big_m, merge_m_sh[ln]);
        float big_l = 0.0;
        [[unroll]] for (uint ln = 0u; ln < MERGE_LANES; ++ln) {
            float f = merge_m_sh[ln] > NEG_INF ? exp(merge_m_sh[ln] - big_m) : 0.0;  // a lane of empty splits adds nothing
            merge_add(f, merge_l_sh[ln], merge_acc_sh[ln * Q4 + c], big_l, sum);
        }
        sum *= 1.0 / big_l;
    }
    barrier();  // shared memory is reused by the next head
    return sum;
}
