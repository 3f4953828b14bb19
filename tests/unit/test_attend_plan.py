"""attend_plan.split_count, the splitting every attention plan uses (pure Python, no device):
its invariants over random arguments, with and without whole rounds of a kernel."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdict_vk.vk.attend.plan import split_count


@settings(max_examples=400, deadline=None)
@given(n_tokens=st.integers(1, 300_000), preferred=st.integers(1, 200), min_tokens=st.integers(1, 1024),
       max_tokens=st.integers(1, 300_000), round_tokens=st.sampled_from([1, 2, 8, 16, 32, 64, 256]))
def test_splits_cover_the_tokens_in_whole_rounds_and_never_more_rounds(n_tokens, preferred, min_tokens,
                                                                        max_tokens, round_tokens):
    n, split_len = split_count(n_tokens, preferred, min_tokens, max_tokens, round_tokens)
    plain_n, plain_len = split_count(n_tokens, preferred, min_tokens, max_tokens)
    # every split holds tokens, and together they hold all of them
    assert 1 <= n and (n - 1) * split_len < n_tokens <= n * split_len
    # within the loop budget
    assert split_len <= max_tokens
    # whole rounds (or one split of everything), where the budget allows it
    if split_len != plain_len:
        assert split_len % round_tokens == 0 or split_len == n_tokens
    # rounding never adds splits, nor rounds to a split
    rounds = lambda length: -(-length // round_tokens)  # noqa: E731
    assert n <= plain_n and rounds(split_len) <= rounds(plain_len)


def test_a_split_of_partial_rounds_becomes_fewer_whole_ones():
    """The case that found it (H200, attend_flash at 8 × 4 heads, d128, 256 invocations: rounds of
    32 tokens): 33 splits of 993 tokens → 32 of 1 024; 3 972 → 4 000 keeps 33."""
    assert split_count(32768, 33, 128, 32768) == (33, 993)
    assert split_count(32768, 33, 128, 32768, 32) == (32, 1024)
    assert split_count(131072, 33, 128, 131072, 32) == (33, 4000)
