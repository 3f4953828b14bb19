"""The fidelity table's quantisers and the gate's rule, on synthetic vectors and a short
model forward: what each baseline stores and costs, and that a full-precision window
changes what attention reads."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk.forge import certify, kivi, llama, pipeline as P, rotated, texts
from kvdict_vk.forge import residual_only as R


def _x(seed=0, t=96):
    return np.random.default_rng(seed).standard_normal((3, t, 64)).astype(np.float32) * 3


def test_kivi_bytes_and_error_fall_with_bits():
    x = _x()
    assert [kivi.bytes_per_vector(b, b) for b in (2, 3, 4, 5)] == [24.0, 32.0, 40.0, 48.0]
    assert kivi.bytes_per_vector(4, 4, recent=128) == pytest.approx((896 * 40 + 128 * 128) / 1024)
    errs = [float(np.mean((kivi.keys(x, b) - x) ** 2)) for b in (2, 3, 4, 5)]
    assert all(a > 3 * b for a, b in zip(errs, errs[1:]))


def test_kivi_groups_are_what_they_say():
    """Keys: one (scale, min) per channel per 32 tokens — a group's extremes come back exactly
    up to binary16 rounding; values: per token, so one token's outlier leaves others alone."""
    x = _x(1)
    k = kivi.keys(x, 2)
    for t0 in (0, 32, 64):
        g, kg = x[:, t0:t0 + 32], k[:, t0:t0 + 32]
        np.testing.assert_allclose(kg.min(1), g.min(1), rtol=2e-3, atol=2e-3)
    y = x.copy()
    y[0, 5, 3] = 1e3
    assert np.array_equal(kivi.values(y, 4)[0, 6], kivi.values(x, 4)[0, 6])


def test_hadamard_is_orthonormal_and_rotation_helps_an_outlier_channel():
    h = rotated.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    x = _x(2)
    x[..., 7] *= 40  # one outlier channel sets every block scale without the rotation
    plain = np.mean((rotated.BLOCK_QUANTISERS["q4_1"][0](x) - x) ** 2)
    assert np.mean((rotated.rotated(x, "q4_1") - x) ** 2) < plain


def test_residual_only_uses_the_codec_stage_and_group_scales_cost_4_bytes():
    x = _x(3)
    ms = R.learn_means_scales([(x, x)])
    k4, _ = R.ResidualOnlyHook(ms, 4, 3)(0, x, x)
    k6, _ = R.ResidualOnlyHook(ms, 6, 3)(0, x, x)
    assert np.mean((k6 - x) ** 2) < np.mean((k4 - x) ** 2) < 0.05 * np.mean(x ** 2)
    assert R.residual_only_bytes(4, 3) == 32.0 and R.residual_only_bytes(4, 4, True) == 40.0


def test_exact_mask_keeps_sink_and_recent_groups():
    class Window(llama.KVHook):
        exact_sink, exact_recent, exact_group = 1, 32, 32
    keep = llama.exact_mask(Window(), np.array([100]), 101)[0]
    assert list(np.flatnonzero(keep)) == [0] + list(range(64, 101))


def test_exact_window_replaces_coded_vectors_in_attention():
    """A hook that destroys K and V changes the NLL; the same hook under a window that
    covers every token gives the f32 NLL back (up to the window's binary16)."""
    toks = np.array(P.tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[:48])

    class Zero(llama.KVHook):
        def __call__(self, layer, k, v):
            return np.zeros_like(k), np.zeros_like(v)

    class ZeroInWindow(Zero):
        exact_recent = 64

    base = llama.token_nll(toks)
    assert np.abs(llama.token_nll(toks, Zero()) - base).max() > 0.5
    assert np.abs(llama.token_nll(toks, ZeroInWindow()) - base).max() < 1e-2


def test_gate_needs_the_upper_bound_within_the_threshold_on_every_text():
    def res(lo, hi):
        return certify.PairedResult(20.0, 20.1, (lo + hi) / 2, (lo, hi), 1000, 1)
    assert P.gate_passed({"a": res(-0.01, 0.009), "b": res(0.0, 0.01)}, 0.01)
    assert not P.gate_passed({"a": res(-0.01, 0.009), "b": res(0.002, 0.011)}, 0.01)
    assert not P.gate_passed({}, 0.01)


def test_evaluation_texts_exist_differ_and_are_not_calibration():
    bodies = {t.name: t.text() for t in texts.EVAL_TEXTS.values()}
    assert all(len(P.tokenizer.encode(b)) > 1024 * t.windows for b, t in zip(bodies.values(), texts.EVAL_TEXTS.values()))
    assert len({certify.text_sha256(b) for b in bodies.values()}) == len(bodies) == 4
    assert not texts.eval_paths() & set(P.calibration_files())
    # the long-context gate's texts hold three 4 096-token windows each (GPL-3 holds one)
    assert all(len(P.tokenizer.encode(bodies[n])) >= 3 * 4096 for n in texts.LONG_TEXTS)
    assert len(P.tokenizer.encode(bodies["gpl3"])) < 2 * 4096


def test_calibration_files_given_stay_disjoint_from_evaluation(tmp_path):
    """--calib-files: the files in the order given, duplicates dropped; an evaluation text or
    a missing file is refused with a typed error."""
    from kvdict_vk import errors as E
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha " * 10)
    b.write_text("beta " * 10)
    assert P.calibration_files([str(b), str(a), str(b)]) == [str(b.resolve()), str(a.resolve())]
    assert P.calibration_files(None) == P.calibration_files(()) == P.calibration_files()
    for bad in (texts.GPL3, texts.EVAL_TEXTS["sedfaq"].path, str(tmp_path / "missing.txt")):
        with pytest.raises(E.KvDictError):
            P.calibration_files([str(a), bad])


def test_calibration_windows_interleave_the_files(tmp_path):
    """Given files: their windows in turn (each file's first, then each one's second, …), a
    .gz file read as gzip; the default concatenates."""
    import gzip
    words = {"a": "the quick brown fox jumps over the lazy dog. ", "b": "lorem ipsum dolor sit amet, consectetur. ",
             "c": "a stitch in time saves nine; "}
    paths = []
    for name, phrase in words.items():
        text = phrase * 60
        if name == "b":
            path = tmp_path / "b.txt.gz"
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path = tmp_path / f"{name}.txt"
            path.write_text(text)
        paths.append(str(path))
    window = 64
    per_file = [llama.eval_windows(P.tokenizer.encode(P.calibration_text(p)), window) for p in paths]
    assert all(len(w) >= 2 for w in per_file)
    depth = min(map(len, per_file))
    got = P.calibration_windows(paths, window, 3 * depth, interleave=True)
    expect = [per_file[f][r] for r in range(depth) for f in range(3)]
    assert all(np.array_equal(g, e) for g, e in zip(got, expect)) and len(got) == 3 * depth
    concat = P.calibration_windows(paths, window, 2, interleave=False)
    assert np.array_equal(concat[0], per_file[0][0])


def test_table_rows_are_selected_by_name(tmp_path, capsys):
    """--table-rows: the rows named, in that order; an unknown name is refused with the known ones
    — by kvdict-forge before it learns or writes anything."""
    from kvdict_vk.forge import cli, table
    assert cli.main(["--out", str(tmp_path / "f"), "--table-rows", "q8_0;KIVI 9 bit"]) == 2
    assert "KIVI 9 bit" in capsys.readouterr().err and not (tmp_path / "f").exists()
    rows = table.baseline_rows(None, 64, 4096)
    assert [r.name for r in table.select(rows, ("KIVI 4 bit + 128 recent", "q8_0"))] == ["KIVI 4 bit + 128 recent", "q8_0"]
    assert table.select(rows, None) is rows
    with pytest.raises(E.KvDictError, match="known: .*KIVI 2 bit"):
        table.select(rows, ("q8_0", "KIVI 9 bit"))
