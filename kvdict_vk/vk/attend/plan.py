"""Planning one decode attention (pure Python, no GPU): which path, how many splits.

Two exact paths over a dict-coded layer (kvdict_vk.vk.attend.engine runs them):

* **table** — attend_table (q·atom for every atom and query head) → attend_split_coded
  (a key costs `sparsity` table lookups, a value adds its coefficients to per-split atom
  weights) → attend_combine → attend_atoms (weights × atoms) → attend_reduce. Reads every
  atom twice per head block whatever the context: it wins on long contexts.
* **direct** — attend_direct decodes every key and value it attends over (Σ c·atom + the
  residual) with an online softmax, then attend_merge (or nothing: one split writes the
  output). Reads `sparsity` atoms per token and stream: it wins on short contexts.

A layer whose streams are both passthrough (the f32 cache) always takes the direct shader,
which then reads f32 rows.

The choice is a cost model in 32-bit words loaded — on llvmpipe every storage-buffer load
costs a per-lane loop whatever the address pattern, so time ≈ words loaded (measured; see
DIRECT_WORD_COST). The words are counted per (KV head, head block) "unit" — each unit's
atoms, tokens and code words — which is the same factor for both paths.
"""
from __future__ import annotations

from dataclasses import dataclass

# Relative cost of a direct-path word against a table-path word: the direct path gathers
# whole atom rows at random per code word, one token after another, while the table and
# atoms passes stream the atoms block. Calibrated on llvmpipe (Mesa 22.3, 2 cores) so the
# model's crossover matches the measured one for the demo configuration (per-head
# dictionaries of 1024 atoms, head_dim 64, 3 KV heads × GQA 3, K 4 atoms + 4 bits, V 4
# atoms + 3 bits): `kvdict-bench attention` (its dict_direct and dict_table modes, side by side).
DIRECT_WORD_COST = 1.0
# Fixed cost of the table path's extra dispatches (table, atoms, combine + reduce instead of
# merge) and their barriers, in words per unit. Same calibration.
TABLE_DISPATCH_WORDS = 0

# Tokens per split: a split's fixed costs (loading its query block, writing its record,
# the merge reading it back — a few head vectors) must stay small next to its tokens.
MIN_DIRECT_SPLIT_TOKENS = 32
MIN_SPLIT_TOKENS = 64  # table path, passthrough V
MIN_SPLIT_TOKENS_WEIGHTS = 256  # table path, dict-coded V: each split zeroes and sums n_atoms weights
# llvmpipe silently ends an invocation's loops after 65535 iterations in total (all loops
# share one counter, LP_MAX_TGSI_LOOP_ITERATIONS); a split stays well below.
LOOP_BUDGET = 60000


def loop_iterations(k_sparsity: int, v_sparsity: int) -> int:
    """Shader-loop iterations attend_split.comp spends per token, as llvmpipe counts them
    (measured: a loop of n iterations costs n + 1): 2 passes plus each coded stream's
    code-word loop (two code words per iteration)."""
    pairs = lambda s: (s + 1) // 2 + 1 if s else 0  # noqa: E731
    return 2 + pairs(k_sparsity) + pairs(v_sparsity)


def direct_loop_iterations(k_sparsity: int, v_sparsity: int) -> int:
    """Iterations attend_direct.comp spends per token: the token loop, then each coded
    stream's code-word loop (one code word per iteration, + 1 for the exit)."""
    return 1 + (k_sparsity + 1 if k_sparsity else 0) + (v_sparsity + 1 if v_sparsity else 0)


def max_split_tokens(path: str, k_sparsity: int, v_sparsity: int) -> int:
    """Tokens one split may hold under llvmpipe's loop budget (a split of the direct path
    runs two token loops — cached, then fresh — hence the 2)."""
    if path == "direct":
        return (LOOP_BUDGET - 2) // direct_loop_iterations(k_sparsity, v_sparsity)
    return LOOP_BUDGET // loop_iterations(k_sparsity, v_sparsity)


def split_count(n_tokens: int, preferred: int, min_tokens: int, max_tokens: int,
                round_tokens: int = 1) -> tuple[int, int]:
    """(splits, tokens per split) for n_tokens ≥ 1: as many as preferred while each keeps
    min_tokens, as many as the loop budget needs, then evened out — and the split length made
    a whole number of the kernel's rounds of ``round_tokens`` where that stays within
    max_tokens (a split runs its last round whole, so 993 tokens in rounds of 32 cost what 1 024
    do: fewer splits of the same rounds each)."""
    n = max(1, min(preferred, -(-n_tokens // min_tokens)), -(-n_tokens // max_tokens))
    split_len = -(-n_tokens // n)
    whole = -(-split_len // round_tokens) * round_tokens
    if whole <= max_tokens:
        split_len = min(whole, n_tokens)
    return -(-n_tokens // split_len), split_len


# --- the cost model ------------------------------------------------------------------------------

def _residual_words(st) -> int:
    return st.level_words + 1 if st.residual_bits else 0


def direct_words(k, v, head_dim: int, hb: int, n_tokens: int) -> int:
    """Words one unit of attend_direct loads over n_tokens (k, v: layout.StreamLayout):
    per token and coded stream the code words, one atom row per code word and the residual
    stage; f32 rows otherwise. Plus the query block, residual scales and its record."""
    def per_token(st):
        return st.sparsity * (1 + head_dim) + _residual_words(st) if st.coded else st.row_words
    fixed = hb * head_dim + 2 * head_dim + hb * (head_dim + 2)
    return n_tokens * (per_token(k) + per_token(v)) + fixed


def table_words(k, v, head_dim: int, hb: int, n_atoms: int, n_tokens: int, n_splits: int) -> int:
    """Words one unit of the table path loads over n_tokens: the q·atom table (every atom,
    the table written), per token the code words, table lookups and residual of K, the
    score written and read back, the code words, atom-weight read-modify-writes and
    residual of V; the atoms pass (every atom, each split's weights read and cleared)."""
    words = TABLE_DISPATCH_WORDS
    if k.coded:
        words += n_atoms * (head_dim + hb) + n_tokens * (k.sparsity * (1 + hb) + _residual_words(k))
    else:
        words += n_tokens * head_dim
    words += 2 * n_tokens * hb  # scores: written, then read by the second pass
    if v.coded:
        words += n_tokens * (v.sparsity * (1 + 2 * hb) + _residual_words(v))
        words += n_atoms * (head_dim + hb * (1 + 2 * n_splits))
    else:
        words += n_tokens * head_dim
    return words


@dataclass(frozen=True)
class Plan:
    """One attention over tokens [0, n_used) of a layer, n_cached of them in the cache (the
    rest fresh: a decode step's new tokens, read from the upload buffer)."""
    path: str  # "direct", "table" or "flash" (kvdict_vk.vk.attend.engine plans that one)
    n_splits: int  # direct: over [0, n_used); table: attend_split_coded over [0, n_cached)
    split_len: int
    fresh_splits: int = 0  # table path in a step: attend_direct over [n_cached, n_used)
    fresh_len: int = 0
    local: int = 0  # flash: invocations per workgroup (0: the kernel's default for the layer)
    heads: int = 0  # flash over codes: query heads per workgroup (0: the layer's default)
    kernel: str = "float"  # flash: the build (flash.FLASH_KERNELS over rows, flash.CODED_KERNELS over codes)
    seqs: int = 1  # flash: sequences attended in one dispatch (batched decode), n_splits each
    split_round: int = 1  # flash: a split is a whole number of these tokens (the kernel's rounds)

    @property
    def records(self) -> int:
        """Splits per KV head the passes after the split ones merge."""
        return self.n_splits + self.fresh_splits

    @property
    def write_out(self) -> bool:
        """One direct split covers every token: it writes the output, no merge pass."""
        return self.path == "direct" and self.n_splits == 1


@dataclass
class Grid:
    """How one engine divides an attention into invocations and splits (kvdict_vk.vk.attend.engine
    makes it; the planner and the passes, kvdict_vk.vk.attend.ops, read it)."""
    group: int  # query heads per KV head
    hb: int  # query heads per invocation of the direct and table passes (engine.head_block)
    units: int  # (KV head, head block) pairs
    local: int  # the direct and table passes' workgroup: a SIMD row (CPU drivers) or GPU_LOCAL
    preferred_splits: int  # splits per KV head the plans aim at (tests lower it)
    max_splits: int  # records per KV head the buffers hold


def plan(k, v, head_dim: int, hb: int, n_atoms: int, n_used: int, n_cached: int, preferred: int,
         force: str | None = None) -> Plan:
    """The cheaper exact path by the cost model (or ``force``: "direct" / "table"), and its
    splits. Passthrough layers and attention over fresh tokens only are always direct."""
    k_s, v_s = (k.sparsity if k.coded else 0), (v.sparsity if v.coded else 0)
    d_max = max_split_tokens("direct", k_s, v_s)
    direct = Plan("direct", *split_count(n_used, preferred, MIN_DIRECT_SPLIT_TOKENS, d_max))
    if not (k.coded or v.coded) or n_cached == 0 or force == "direct":
        return direct
    min_tokens = MIN_SPLIT_TOKENS_WEIGHTS if v.coded else MIN_SPLIT_TOKENS
    n, split_len = split_count(n_cached, preferred, min_tokens, max_split_tokens("table", k_s, v_s))
    fresh = split_count(n_used - n_cached, 1, 1, d_max) if n_used > n_cached else (0, 0)
    table = Plan("table", n, split_len, *fresh)
    if force == "table":
        return table
    cost_direct = DIRECT_WORD_COST * direct_words(k, v, head_dim, hb, n_used)
    cost_table = table_words(k, v, head_dim, hb, n_atoms, n_cached, n) \
        + (direct_words(k, v, head_dim, hb, n_used - n_cached) if n_used > n_cached else 0)
    return direct if cost_direct <= cost_table else table


def max_records(k, v, n_ctx: int, preferred: int) -> int:
    """Splits per KV head any plan of this layer may need (the buffers are sized for it):
    the direct path's, or the table path's plus the fresh split of a step."""
    k_s, v_s = (k.sparsity if k.coded else 0), (v.sparsity if v.coded else 0)
    direct = max(preferred, -(-n_ctx // max_split_tokens("direct", k_s, v_s)))
    if not (k.coded or v.coded):
        return direct
    return max(direct, max(preferred, -(-n_ctx // max_split_tokens("table", k_s, v_s))) + 1)
