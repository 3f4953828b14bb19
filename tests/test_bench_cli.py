"""kvdict-bench: JSON per benchmark and a summary whose ratios are the benchmarks' medians,
exit 2 on bad arguments, 1 on a failed benchmark, a skip (exit 0) when an optional
dependency is missing; the progress line plain off a terminal, rewritten in place on one.

The GPU run uses --quick with 2 repeats (omp and reconstruct: ~10 s on lavapipe).
"""
from __future__ import annotations

import io
import json
import math

import pytest

from kvdict_vk import errors as E
from kvdict_vk.bench import common, omp
from kvdict_vk.cli import bench


@pytest.fixture
def restore_env(monkeypatch):
    """The benchmarks disable the validation layer through the environment (for Vulkan
    instances made later): undo it after the test, the session's layer gate relies on it."""
    monkeypatch.setenv("VK_LOADER_LAYERS_DISABLE", "")


def _positive_finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.gpu
def test_omp_and_reconstruct_summary_matches_their_json(tmp_path, capsys, restore_env, vk_device):
    pytest.importorskip("sklearn")
    code = bench.main(["omp", "reconstruct", "--quick", "--repeats", "2", "--out-dir", str(tmp_path), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert printed == summary
    assert list(summary["benchmarks"]) == ["omp", "reconstruct"]
    assert summary["quick"] is True and summary["device"] == vk_device.name
    per = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("omp", "reconstruct")}
    for name, entry in summary["benchmarks"].items():
        assert entry["json"] == str(tmp_path / f"{name}.json")
        assert entry["png"] is None or (tmp_path / f"{name}.png").is_file()
        assert entry["headline"], name
        for fig in entry["headline"]:
            assert all(_positive_finite(fig[k]) for k in ("numerator", "denominator", "ratio")), fig
            assert fig["ratio"] == pytest.approx(fig["numerator"] / fig["denominator"], rel=1e-12)

    o = per["omp"]
    (omp_fig,) = summary["benchmarks"]["omp"]["headline"]
    assert o["n_vectors"] == 5000 and o["n_vectors_sklearn"] == 300 and len(o["kvdict_vk_vec_per_s"]["all"]) == 2
    assert omp_fig["ratio"] == pytest.approx(
        o["kvdict_vk_vec_per_s"]["median"] / o["sklearn_vec_per_s"]["median"], rel=1e-12)

    r = per["reconstruct"]
    (rec_fig,) = summary["benchmarks"]["reconstruct"]["headline"]
    assert r["sweep"] == [] and r["config"]["repeats"] == 2 and len(r["main"]["reconstruct"]["samples"]) == 2
    assert rec_fig["ratio"] == pytest.approx(r["main"]["copy_shader"]["median"] / r["main"]["reconstruct"]["median"],
                                             rel=1e-12)
    assert rec_fig["goal"] == {"at_least": 0.7, "met": rec_fig["ratio"] >= 0.7}


@pytest.mark.gpu
def test_unknown_device_exits_2(tmp_path, capsys, restore_env, vk_device):
    assert bench.main(["reconstruct", "--device", "no-such-device", "--out-dir", str(tmp_path)]) == 2
    assert "no usable Vulkan device" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("argv", [["nosuch"], ["omp", "--repeats", "0"], ["--repeats", "x"], ["--bogus"]])
def test_bad_arguments_exit_2(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main(argv + ["--out-dir", str(tmp_path)])
    assert e.value.code == 2
    assert not (tmp_path / "summary.json").exists()


def test_missing_optional_dependency_skips(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(omp, "REQUIRES", {"kvdict_no_such_module": "no-such-package"})
    assert bench.main(["omp", "--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["benchmarks"]["omp"] == {"skipped": "needs no-such-package (not installed)"}
    assert summary["device"] is None  # omp alone needs no Vulkan device
    out = capsys.readouterr()
    assert "omp: skipped" in out.err and "skipped" in out.out


def test_typed_error_fails_the_benchmark_in_one_line(tmp_path, monkeypatch, capsys):
    def broken(args, progress):
        progress("about to fail")
        raise E.ShapeError("bad shape\nsecond line")
    monkeypatch.setattr(omp, "run", broken)
    monkeypatch.setattr(omp, "REQUIRES", {})
    assert bench.main(["omp", "--quick", "--out-dir", str(tmp_path), "--json"]) == 1
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if "failed" in line]
    assert failed == ["[kvdict-bench] omp: failed: ShapeError: bad shape"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["benchmarks"]["omp"]["failed"].startswith("ShapeError: bad shape")


def test_quick_and_repeats_become_the_benchmarks_options(tmp_path):
    a = bench.parse_args(["attention", "omp", "attention", "--quick", "--repeats", "4", "--device", "llvmpipe",
                          "--out-dir", str(tmp_path)])
    assert a.names == ["attention", "omp"]
    args = bench.BENCHMARKS["attention"].parse_args(bench.bench_argv("attention", a))
    assert (args.n_used, args.repeats, args.device) == ("1024,4096", 4, "llvmpipe")
    assert args.out == tmp_path / "attention.json"
    assert "--device" not in bench.bench_argv("omp", a)  # CPU only: takes no --device
    assert bench.parse_args([]).names == ["attention", "encode", "omp", "reconstruct"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_plain_lines_off_a_terminal():
    out = io.StringIO()
    p = common.Progress("omp", out)
    p("repeat 1/2")
    p("repeat 2/2")
    p.end()
    assert out.getvalue() == "[omp] repeat 1/2\n[omp] repeat 2/2\n"


def test_progress_rewrites_one_line_on_a_terminal():
    out = _Terminal()
    p = common.Progress("omp", out)
    p("a longer step")
    p("short")
    p.end()
    p.end()  # a second end() adds nothing
    # the shorter step is padded over what the longer one left on the line
    assert out.getvalue() == "\r[omp] a longer step" + "\r[omp] short" + " " * 8 + "\n"
    assert "\n" not in out.getvalue()[:-1]
