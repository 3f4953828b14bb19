"""forge.ranking: a fidelity row's cache read from its name, the certified caches ranked by
their whole arena at the model's context, the winner and why — a dictionary or not."""
from __future__ import annotations

import pytest

from kvdict_vk import kivi as K
from kvdict_vk import memory_report as M
from kvdict_vk.forge import ranking
from kvdict_vk.window import ExactWindow

SHAPES = (30, 3, 64)
DICT = "dict 1024 shared atoms, K 4+6 b, V 4+4 b"


def _row(name, kind, upper, bpv=60.0, texts=("gpl3", "pydoc")):
    return dict(name=name, kind=kind, bytes_per_vector=bpv,
                texts={t: dict(delta_rel=upper / 2 + i * 1e-4, ci95=[upper / 4, upper - i * 1e-3])
                       for i, t in enumerate(texts)})


def test_names_read_as_the_engine_caches():
    assert ranking.cache_of("q8_0", 68, SHAPES) == ("q8_0", "engine")
    assert ranking.cache_of("KIVI 4 bit + 128 recent", 51, SHAPES) == (K.KiviSpec(4, 4, 128), "engine")
    assert ranking.cache_of("KIVI K5 V4", 44, SHAPES) == (K.KiviSpec(5, 4, 0), "engine")
    spec, how = ranking.cache_of(DICT, 60, SHAPES)
    assert how == "engine" and not spec.window and spec.n_heads == 1
    for suffix, window in ((" + sink + 32 recent", ExactWindow(1, 32)), (" + sink 2 + 64 recent", ExactWindow(2, 64)),
                           (" + 16 recent", ExactWindow(0, 16)), (" + sink 4", ExactWindow(4, 0))):
        spec, how = ranking.cache_of(DICT + suffix, 60, SHAPES)
        assert how == "engine" and spec.window == window, suffix
    spec, how = ranking.cache_of(DICT + ", keys before RoPE + sink + 32 recent", 60, SHAPES)
    assert how == "engine" and spec.window == ExactWindow(1, 32) and spec.key_rope.dims == 64
    plain = M.arena_memory(*SHAPES, ranking.cache_of(DICT + " + sink + 32 recent", 60, SHAPES)[0], (8192,))[0]
    turned = M.arena_memory(*SHAPES, spec, (8192,))[0]  # each layer's rotation table: (64 + 128) rows of 64 floats
    assert turned.arena_bytes - plain.arena_bytes == 30 * (64 + 128) * 64 * 4
    _, how = ranking.cache_of(DICT.replace("shared ", "") + " + group scales", 64, SHAPES)
    assert how.startswith("modelled")
    with pytest.raises(ValueError, match="no cache configuration"):
        ranking.cache_of("zstd", 10, SHAPES)


def test_the_smallest_passing_arena_wins_and_a_winner_not_a_dictionary_is_said_plainly():
    rows = [_row(DICT, "dictionary", 0.006), _row("q8_0", "q8_0", 0.001, 68),
            _row("KIVI 4 bit + 128 recent", "kivi", 0.009, 51), _row("KIVI 2 bit", "kivi", 1.1, 24),
            _row("Hadamard + q4_1", "rotated", 0.06, 40)]  # a lever the engine does not keep: not ranked
    r = ranking.rank(rows, SHAPES, 8192, 0.01)
    assert [x["name"] for x in r["rows"]] == ["KIVI 4 bit + 128 recent", DICT, "q8_0", "KIVI 2 bit"]
    assert [x["passes"] for x in r["rows"]] == [True, True, True, False]
    assert r["winner"] == "KIVI 4 bit + 128 recent" and r["winner_kind"] == "kivi"
    assert "not a dictionary" in r["reason"] and "next: " + DICT in r["reason"]
    arenas = [x["arena_bytes"] for x in r["rows"][:3]]
    assert arenas == sorted(arenas)
    kivi_at = M.arena_memory(*SHAPES, K.KiviSpec(), (8192,))[0].arena_bytes
    assert r["rows"][0]["arena_bytes"] == kivi_at
    worst = r["rows"][0]
    assert worst["worst_text"] == "gpl3" and worst["worst_upper"] == pytest.approx(0.009)
    assert ranking.engine_cache(r["winner"], SHAPES) == ("kivi", K.KiviSpec(4, 4, 128))


def test_a_dictionary_wins_where_the_smaller_caches_fail_and_none_may_pass():
    rows = [_row(DICT, "dictionary", 0.006), _row("q8_0", "q8_0", 0.001, 68),
            _row("KIVI 4 bit + 128 recent", "kivi", 0.012, 51)]
    r = ranking.rank(rows, SHAPES, 8192, 0.01)
    assert r["winner"] == DICT and "not a dictionary" not in r["reason"]
    assert ranking.engine_cache(DICT, SHAPES) == ("dict", None)
    r = ranking.rank([_row("KIVI 2 bit", "kivi", 1.1, 24)], SHAPES, 8192, 0.01)
    assert r["winner"] is None and "no cache passes" in r["reason"]


def test_a_row_given_its_cache_is_ranked_by_it():
    """The certified artifact's row: its arena is the artifact's own (here: per-head dictionaries)."""
    per_head = M.dictionary_spec(*SHAPES, per_head=True)
    r = ranking.rank([_row(DICT, "dictionary", 0.006)], SHAPES, 8192, 0.01, caches={DICT: per_head})
    assert r["rows"][0]["arena_bytes"] == M.arena_memory(*SHAPES, per_head, (8192,))[0].arena_bytes
    assert r["rows"][0]["arena_bytes"] > ranking.rank([_row(DICT, "dictionary", 0.006)], SHAPES, 8192,
                                                      0.01)["rows"][0]["arena_bytes"]


def test_dictionaries_shared_by_layers_are_modelled_with_their_tails_once_a_run():
    """The forge's layer_share rows: not an engine cache (the engine keeps each layer's atoms),
    modelled as the dictionary arena with its tails stored once per run of layers, a window
    or not."""
    shapes = (30, 3, 64)
    plain, how = ranking.cache_of("dict 1024 shared atoms, K 4+6 b, V 4+4 b", 60, shapes)
    at = M.arena_memory(*shapes, plain, (8192,))[0]
    for suffix in ("", " + sink 1 + 32 recent"):
        c, how = ranking.cache_of("dict 1024 shared atoms, K 4+6 b, V 4+4 b + 2 layers a dictionary" + suffix, 60, shapes)
        assert how.startswith("modelled") and isinstance(c, M.Modelled)
        shared = M.arena_memory(*shapes, c, (8192,))[0]
        window = M.arena_memory(*shapes, c.base, (8192,))[0].arena_bytes - at.arena_bytes
        assert shared.arena_bytes == at.arena_bytes + window - at.tail_bytes // 2  # 15 runs of 30 layers
    c, _ = ranking.cache_of("dict 1024 shared atoms, K 4+6 b, V 4+4 b + 4 layers a dictionary", 60, shapes)
    per_layer = at.tail_bytes // 30
    assert M.arena_memory(*shapes, c, (8192,))[0].arena_bytes == at.arena_bytes - per_layer * (30 - 8)  # 8 runs
