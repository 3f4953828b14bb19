"""kvdict-bench: summary.json with the results schema (device, driver, roofline, fixed
costs, rows), what the rows say checked against the work done (bytes from the layout,
the modes computing the same attention, GPU time inside the wall time), presets that
size a GPU run past its L2, exit 2 on bad arguments, 1 on a failed benchmark, a skip
(exit 0) when an optional dependency is missing; the progress line plain off a
terminal, rewritten in place on one. No test asserts a speed.

The GPU run uses --quick with 2 repeats (fixed, attention, reconstruct: ~10 s on lavapipe).
"""
from __future__ import annotations

import io
import json
import sys
import types

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk import layout as L
from kvdict_vk.bench import attention, common, fixed, omp, reconstruct, results, roofline, torch_anchor, traffic
from kvdict_vk.cli import bench
from kvdict_vk.vk.attend.plan import Plan

L2_BYTES = 60e6  # the H200's L2: the GPU preset's working sets must be well past it


def _rows(summary, benchmark):
    return [r for r in summary["rows"] if r["benchmark"] == benchmark]


@pytest.mark.gpu
def test_quick_run_of_the_device_benchmarks(tmp_path, restore_env, vk_device):
    """One quick run (the CI smoke run, without encode and omp), checked from several sides."""
    code = bench.main(["fixed", "attention", "reconstruct", "--quick", "--repeats", "2", "--out-dir", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    _check_schema(summary, tmp_path, vk_device)
    _check_gpu_time_inside_wall_time(summary)
    _check_attention(summary, json.loads((tmp_path / "attention.json").read_text()))
    _check_reconstruct_and_fixed(summary, tmp_path)
    _check_resummarize(summary, tmp_path)


def _check_resummarize(summary, out):
    """--resummarize writes the same rows, fixed costs, headlines and device from the JSONs
    alone, measuring nothing; anchors carry over only from a summary of the same device."""
    argv = ["fixed", "attention", "reconstruct", "--quick", "--out-dir", str(out), "--resummarize"]
    assert bench.main(argv) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["rows"] == summary["rows"] and again["fixed_costs_us"] == summary["fixed_costs_us"]
    for key in ("device", "driver", "device_kind", "timestamps", "preset"):
        assert again[key] == summary[key], key
    recorded = json.loads((out / "attention.json").read_text())["roofline"]
    assert again["roofline"] == {k: v for k, v in recorded.items() if k in bench.ROOFLINE_KEYS}
    for name in ("fixed", "attention", "reconstruct"):
        old, new = summary["benchmarks"][name], again["benchmarks"][name]
        assert new["headline"] == old["headline"] and new["argv"] == old["argv"] and new["rows"] == old["rows"]
        assert new["when"] == json.loads((out / f"{name}.json").read_text())["when"]
    assert any("re-summarised" in n for n in again["notes"])
    anchors = {"available": True, "note": None, "info": None, "cuda_tiny_kernel_sync_us": 20.0,
               "torch_copy_bytes": 1 << 30, "torch_copy_bytes_per_s": 4e12}
    for device, kept in ((summary["device"], True), ("another device", False)):
        (out / "summary.json").write_text(json.dumps({**again, "device": device, "anchors": anchors}))
        assert bench.main(argv) == 0
        assert json.loads((out / "summary.json").read_text())["anchors"] == (anchors if kept else None)


def _check_schema(summary, out, dev):
    assert summary["device"] == dev.name and dev.info.driver_name in summary["driver"]
    assert summary["command"].startswith("kvdict-bench fixed attention reconstruct --quick")
    assert summary["preset"] == "quick" and summary["device_kind"] == ("cpu" if dev.is_cpu else "gpu")
    assert summary["roofline"]["bytes"] == roofline.size_for(dev) and summary["roofline"]["bytes_per_s"] > 0
    assert set(summary["fixed_costs_us"]) == set(fixed.COSTS)
    assert all(v > 0 for v in summary["fixed_costs_us"].values())
    results.check(summary["rows"])  # every required key, (benchmark, case) unique
    for name in ("fixed", "attention", "reconstruct"):
        assert (out / f"{name}.json").is_file()
        assert summary["benchmarks"][name]["headline"]


def _check_gpu_time_inside_wall_time(summary):
    timed = [r for r in summary["rows"] if r["gpu_s"] is not None]
    if summary["timestamps"]:
        assert timed, "a device with timestamps gave no GPU time"
    for r in summary["rows"]:
        if r["gpu_s"] is None:
            assert r["notes"], r["case"]  # says why
        else:  # a tick-conversion error (ns for s, the wrong period) lands far outside
            assert 0 < r["gpu_s"] <= r["wall_s"], r["case"]


def _check_attention(summary, result):
    args = attention.parse_args(attention.PRESETS["quick"])
    rows = _rows(summary, "attention")
    for n in args.n_used_list:
        assert {r["cache"] for r in rows if r["n_used"] == n} == {"f16", "f32", "q8_0", "kivi", "dict"}, n
    by_case = {r["case"]: r for r in rows}
    n_kv, gqa, hd, n = args.n_kv, args.gqa, args.head_dim, args.n_used_list[0]
    # K and V of every token read once: an f16 row is half an f32 row
    assert by_case[f"f16 {n_kv}x{gqa} d{hd} n{n}"]["bytes_by_part"]["cache"] == 2 * n_kv * n * hd * 2
    assert by_case[f"f32 {n_kv}x{gqa} d{hd} n{n}"]["bytes_by_part"]["cache"] == 2 * n_kv * n * hd * 4
    for case in result["cases"]:  # every mode computed the attention it claims to time
        for r in case["by_n_used"]:
            checks = r["checks"]
            assert checks["f16_vs_f32_nmse"] < 1e-5  # f16 rounding of unit-variance rows: ~1e-7
            assert checks["q8_0_vs_f32_nmse"] < 1e-3  # q8_0 rounding: ~1e-5
            assert 1e-9 < checks["kivi_vs_f32_nmse"] < 1e-1  # 4-bit KIVI over the tokens past the window
            assert all(v < 1e-9 for k, v in checks.items() if not k.endswith("_vs_f32_nmse")), checks
    if torch_anchor.anchor()[0] is None:
        assert all(r["torch_sdpa_f16_s"] is None for r in rows)
        assert result["sdpa"]["available"] is False and result["sdpa"]["note"]


def _check_reconstruct_and_fixed(summary, out):
    rec = json.loads((out / "reconstruct.json").read_text())
    assert rec["main"]["nmse_vs_float64"] < 1e-9
    rows = {r["case"].split(" ")[0]: r for r in _rows(summary, "reconstruct")}
    assert {"reconstruct", "copy", "f32", "f16", "readback"} <= set(rows)
    assert rows["f32"]["cache"] == "f32" and rows["f16"]["cache"] == "f16" and rows["reconstruct"]["cache"] == "dict"
    assert rows["readback"]["roofline_fraction"] is None  # a transfer to the host, not a shader
    costs = json.loads((out / "fixed.json").read_text())
    c = fixed.parse_args(fixed.PRESETS["quick"])
    assert costs["costs"]["decode_step_layer"]["n_used"] == c.prefill + c.steps + 1  # warm-up + timed steps


@pytest.mark.gpu
def test_omp_summary_rows(tmp_path, capsys, restore_env, vk_device):
    import sklearn  # noqa: F401 — the omp benchmark needs it (the test extra); missing is a failure
    assert bench.main(["omp", "--quick", "--repeats", "2", "--out-dir", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["device"] is None and summary["roofline"] is None  # CPU only: no Vulkan device opened
    o = json.loads((tmp_path / "omp.json").read_text())
    assert o["n_vectors"] == 5000 and o["n_vectors_sklearn"] == 300 and len(o["kvdict_vk_vec_per_s"]["all"]) == 2
    assert o["same_atoms_fraction"] > 0.9  # the same OMP as scikit-learn's, not just a fast one
    rows = _rows(summary, "omp")
    assert [r["device_kind"] for r in rows] == ["cpu", "cpu"] and all(r["vectors_per_s"] > 0 for r in rows)


def test_resummarize_without_a_benchmark_json_fails_that_entry(tmp_path, capsys):
    assert bench.main(["omp", "--out-dir", str(tmp_path), "--resummarize", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert "no " in summary["benchmarks"]["omp"]["failed"] and summary["rows"] == []
    assert not (tmp_path / "omp.json").exists()


def test_resummarize_skips_an_absent_json_of_a_benchmark_that_could_not_run_here(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(omp, "REQUIRES", {"kvdict_no_such_module": "no-such-package"})
    assert bench.main(["omp", "--out-dir", str(tmp_path), "--resummarize", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["benchmarks"]["omp"]
    assert entry == {"skipped": f"no {tmp_path / 'omp.json'} (needs no-such-package (not installed))"}


@pytest.mark.gpu
def test_unknown_device_exits_2(tmp_path, capsys, restore_env, vk_device):
    assert bench.main(["reconstruct", "--device", "no-such-device", "--out-dir", str(tmp_path)]) == 2
    assert "no usable Vulkan device" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


# --- no device needed ----------------------------------------------------------------------------

# Seconds per repeat, injected in place of the clock: vectors/s, their medians and the
# ratios are worked out by hand below (--quick: 5000 vectors for kvdict_vk, 300 for sklearn).
KNOWN_SECONDS = {"kvdict_vk": [0.5, 0.25, 0.4], "sklearn": [3.0, 2.0, 6.0]}


def test_omp_headline_from_known_timings(tmp_path, monkeypatch, capsys):
    import sklearn  # noqa: F401 — the omp benchmark needs it (the test extra)

    def known_timings(candidates, repeats, after_repeat=None):
        assert set(candidates) == set(KNOWN_SECONDS) and repeats == 3
        last = {name: fn() for name, fn in candidates.items()}  # the real work, once each
        for rep in range(repeats):
            if after_repeat:
                after_repeat(rep, {n: s[:rep + 1] for n, s in KNOWN_SECONDS.items()})
        return {n: list(s) for n, s in KNOWN_SECONDS.items()}, last

    monkeypatch.setattr(common, "interleaved", known_timings)
    assert bench.main(["omp", "--quick", "--repeats", "3", "--out-dir", str(tmp_path), "--json"]) == 0
    (fig,) = json.loads(capsys.readouterr().out)["benchmarks"]["omp"]["headline"]
    # kvdict_vk: 10 000, 20 000, 12 500 vec/s → median 12 500; sklearn: 100, 150, 50 → 100
    assert fig["numerator"] == pytest.approx(12_500) and fig["denominator"] == pytest.approx(100)
    assert fig["ratio"] == pytest.approx(125)
    # paired per repeat: 100, 133.3, 250 → median 133.3
    assert fig["paired_ratio_median"] == pytest.approx(400 / 3)
    o = json.loads((tmp_path / "omp.json").read_text())
    assert o["kvdict_vk_vec_per_s"]["all"] == pytest.approx([10_000, 20_000, 12_500])
    assert (o["speedup"]["min"], o["speedup"]["max"]) == pytest.approx((100, 250))

@pytest.mark.parametrize("argv", [["nosuch"], ["omp", "--repeats", "0"], ["--repeats", "x"], ["--bogus"],
                                  ["--quick", "--preset", "gpu"], ["--preset", "huge"]])
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
    assert summary["device"] is None and summary["rows"] == []  # omp alone needs no Vulkan device
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


def test_a_bug_in_one_benchmark_is_a_failed_entry_with_its_traceback(tmp_path, monkeypatch, capsys):
    def buggy(args, progress):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(omp, "run", buggy)
    monkeypatch.setattr(omp, "REQUIRES", {})
    assert bench.main(["omp", "--quick", "--out-dir", str(tmp_path)]) == 1
    assert "Traceback" in capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["benchmarks"]["omp"] == {"failed": "ZeroDivisionError: division by zero"}


def test_presets_and_repeats_become_the_benchmarks_options(tmp_path):
    a = bench.parse_args(["attention", "omp", "attention", "--quick", "--repeats", "4", "--device", "llvmpipe",
                          "--out-dir", str(tmp_path)])
    assert a.names == ["attention", "omp"]
    args = attention.parse_args(bench.bench_argv("attention", a, "quick"))
    assert (args.n_used, args.repeats, args.device) == ("1024,4096", 4, "llvmpipe")
    assert args.out == tmp_path / "attention.json"
    assert "--device" not in bench.bench_argv("omp", a, "quick")  # CPU only: takes no --device
    assert bench.parse_args([]).names == ["fixed", "attention", "encode", "omp", "reconstruct", "llama_fa"]
    for name, mod in bench.BENCHMARKS.items():
        assert set(mod.PRESETS) == set(common.PRESETS), name
        mod.parse_args(bench.bench_argv(name, bench.parse_args([]), "gpu"))  # every preset parses


def test_default_preset_follows_the_device_kind():
    cpu, gpu = (types.SimpleNamespace(is_cpu=flag) for flag in (True, False))
    assert common.preset_for(cpu) == "cpu" and common.preset_for(gpu) == "gpu"


def test_gpu_preset_sizes_are_past_a_gpu_l2():
    att = attention.parse_args(attention.PRESETS["gpu"])
    from kvdict_vk.dictionary import FORGE_PER_HEAD
    for preset in attention.PRESETS:  # the certified format's dictionaries: the forge's sharing
        assert attention.parse_args(attention.PRESETS[preset]).per_head == FORGE_PER_HEAD
    assert set(att.shape_list) == {(8, 4), (3, 3)} and set(att.head_dim_list) == {64, 128}
    assert att.n_used_list == [8192, 32768, 131072]
    biggest = max(2 * n_kv * max(att.n_used_list) * hd * 2 for n_kv, _ in att.shape_list for hd in att.head_dim_list)
    assert biggest > 4 * L2_BYTES  # the f16 cache at the longest context
    rec = reconstruct.parse_args(reconstruct.PRESETS["gpu"])
    assert 2 * rec.n_kv * rec.n_ctx * rec.head_dim * 4 >= 1 << 30  # ≥ 1 GiB of output per read
    assert roofline.GPU_BYTES >= 1 << 30


def _layout(cache="f16", n_kv=3, hd=64, n_ctx=4096):
    return L.build_layout(1, n_kv, hd, n_ctx, cache=cache)


def test_traffic_of_uncoded_caches_counts_each_row_once():
    n = 1000
    for cache, width in (("f16", 2), ("f32", 4)):
        lay = _layout(cache)
        direct = traffic.bytes_moved("attend", lay, 0, n, plan=Plan("direct", 1, n), n_heads=9)
        assert direct["cache"] == 2 * 3 * n * 64 * width and direct["dictionary"] == 0
        assert direct["scratch"] == 0  # one split writes the output itself
        split = traffic.bytes_moved("attend", lay, 0, n, plan=Plan("direct", 4, 250), n_heads=9)
        assert split["scratch"] == 2 * 3 * 4 * 3 * (64 + 2) * 4  # records: written, read by the merge
        assert traffic.bytes_moved("attend", lay, 0, n, plan=Plan("flash", 4, 250), n_heads=9) == split
        with pytest.raises(ValueError, match="no byte count"):
            traffic.bytes_moved("attend", lay, 0, n, plan=Plan("someday", 4, 250), n_heads=9)
        read = traffic.bytes_moved("read", lay, 0, n)
        assert read["output"] == 2 * 3 * n * 64 * 4 and read["total"] == read["cache"] + read["output"]
    assert traffic.bytes_moved("copy", n_words=256) == {"cache": 1024, "dictionary": 0, "scratch": 0,
                                                         "output": 1024, "total": 2048}


def test_traffic_of_a_coded_cache_counts_the_atoms_it_can_touch():
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    rng = np.random.default_rng(1)
    d = StreamDict(rng.standard_normal((1024, 64)).astype(np.float32), sparsity=8)
    lay = L.build_layout(1, 3, 64, 4096, KvDictArtifact(64, 1024, 8, ((d, d),)))
    few = traffic.bytes_moved("attend", lay, 0, 10, plan=Plan("direct", 1, 10), n_heads=9)
    assert few["cache"] == 2 * 3 * 10 * 8 * 4
    assert few["dictionary"] == 2 * (3 * 10 * 8) * 64 * 4  # 240 code words per stream name ≤ 240 atoms
    many = traffic.bytes_moved("attend", lay, 0, 4096, plan=Plan("direct", 1, 4096), n_heads=9)
    assert many["dictionary"] == 2 * 1024 * 64 * 4  # at most the whole block
    table = traffic.bytes_moved("attend", lay, 0, 10, plan=Plan("table", 1, 10), n_heads=9)
    assert table["dictionary"] == 2 * 1024 * 64 * 4  # the table and atoms passes stream every atom
    recon = traffic.bytes_moved("reconstruct_then_attend", lay, 0, 10, plan=Plan("direct", 1, 10), n_heads=9)
    assert recon["scratch"] == 2 * (2 * 3 * 10 * 64) * 4  # f32 rows written, then read by the attention


def test_rows_name_each_case_once_and_carry_the_schema():
    t = {"wall_s": 2e-3, "gpu_s": 1e-3}
    roof = {"bytes_per_s": 1e9, "timing": "gpu"}
    r = results.row("attention", "f16 3x3 d64 n8", t, cache="f16", moved={"cache": 1000, "total": 1e6},
                    roofline=roof, torch_sdpa_f16_s=5e-4)
    assert r["roofline_fraction"] == pytest.approx(1.0) and r["vs_torch_sdpa"] == pytest.approx(2.0)
    assert r["bytes_per_s"] == pytest.approx(1e9)  # GPU time when there is one
    results.check([r])
    with pytest.raises(ValueError, match="two rows"):
        results.check([r, dict(r)])
    with pytest.raises(ValueError, match="lacks"):
        results.check([{k: v for k, v in r.items() if k != "gpu_s"}])
    with pytest.raises(ValueError):
        results.row("attention", "x", t, cache="bf16")
    # a recording whose core ops are timed: the fraction over them, as the SDPA ratio
    cored = results.row("attention", "f16 3x3 d64 n16", dict(t, kernel_s=5e-4), cache="f16", moved={"total": 1e6},
                        roofline=roof, torch_sdpa_f16_s=5e-4)
    assert cored["roofline_fraction"] == pytest.approx(2.0) and cored["vs_torch_sdpa"] == pytest.approx(1.0)
    assert cored["bytes_per_s"] == pytest.approx(1e9)  # still over gpu_s (timing.best_seconds)
    wall_roof = results.row("attention", "x", dict(t, kernel_s=5e-4), moved={"total": 1e6},
                            roofline={"bytes_per_s": 1e9, "timing": "wall"})
    assert wall_roof["roofline_fraction"] == pytest.approx(0.5)  # a wall-timed roofline: over wall_s
    wall_only = results.row("encode", "x", {"wall_s": 2e-3, "gpu_s": None, "note": "why"}, moved={"total": 1e6},
                            roofline=roof)
    assert wall_only["roofline_fraction"] is None and wall_only["notes"] == ["why"]  # no GPU time to divide


def test_sdpa_column_says_why_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    torch, note = torch_anchor.anchor()
    assert torch is None and "torch is not installed" in note
    a = torch_anchor.Anchor()
    assert a.seconds(8, 4, 64, 8192) is None and a.to_dict()["available"] is False
    no_cuda = types.SimpleNamespace(__version__="9.9", cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", no_cuda)
    assert torch_anchor.anchor() == (None, "torch 9.9 sees no CUDA device")


class _FakeTorch(types.SimpleNamespace):
    """Just enough of torch for torch_anchor.time_sdpa: tensors are shapes, the event clock counts
    SDPA calls (each takes one "ms"), ``enable_gqa`` optional (torch < 2.5 lacks it), and
    ``cuda._sleep`` optional (a private API), its GPU asleep until the next synchronize."""

    def __init__(self, has_gqa: bool, has_sleep: bool = True):
        self.calls, self.shapes, self.asleep = 0, [], False
        self.flushes = []  # ("read" | "write", SDPA calls before it): the L2 flushes enqueued
        torch = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = torch.calls

            def elapsed_time(self, end):  # ms
                return float(end.t - self.t)

            def query(self):  # complete unless the GPU is still asleep
                return not torch.asleep

        class Tensor:
            def __init__(self, shape):
                self.shape = tuple(shape)

            def repeat_interleave(self, n, dim):
                return Tensor(self.shape[:dim] + (self.shape[dim] * n,) + self.shape[dim + 1:])

            def add_(self, x):
                torch.calls += 1

            def copy_(self, src):
                assert src.shape == self.shape
                torch.calls += 1

            def sum(self):  # the L2 flush's read: outside any SDPA call's events
                torch.flushes.append(("read", torch.calls))

            def zero_(self):
                torch.flushes.append(("write", torch.calls))

        def sdpa(q, k, v, **kw):
            if "enable_gqa" in kw and not has_gqa:
                raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
            if not kw and k.shape[1] != q.shape[1]:
                raise RuntimeError("heads differ without enable_gqa")
            torch.calls += 1
            torch.shapes.append((q.shape, k.shape))
            return q

        super().__init__(
            __version__="2.x", float16="f16", float32="f32",
            Generator=lambda device: types.SimpleNamespace(manual_seed=lambda s: None),
            randn=lambda *shape, **kw: Tensor(shape), zeros=lambda *shape, **kw: Tensor(shape),
            empty=lambda *shape, **kw: Tensor(shape), empty_like=lambda t: Tensor(t.shape),
            ones=lambda *shape, **kw: Tensor(shape),
            nn=types.SimpleNamespace(functional=types.SimpleNamespace(scaled_dot_product_attention=sdpa)),
            cuda=types.SimpleNamespace(is_available=lambda: True, synchronize=self._synchronize, Event=Event,
                                       empty_cache=lambda: None, get_device_name=lambda i: "Fake GPU"))
        if has_sleep:
            self.cuda._sleep = self._sleep

    def _sleep(self, cycles):
        assert cycles > 0 and isinstance(cycles, int)
        self.asleep = True

    def _synchronize(self):
        self.asleep = False


@pytest.mark.parametrize("has_gqa, how", [(True, "enable_gqa"), (False, "repeat_interleave")])
def test_sdpa_anchor_times_grouped_query_attention(monkeypatch, has_gqa, how):
    fake = _FakeTorch(has_gqa)
    monkeypatch.setitem(sys.modules, "torch", fake)
    a = torch_anchor.Anchor(calls=5)
    assert a.info["cuda_device"] == "Fake GPU"
    seconds = a.seconds(8, 4, 64, 1024)
    r = a.results[(8, 4, 64, 1024, 1)]
    assert r["gqa"].startswith(how) and r["samples"] == [1e-3] * 5 and seconds == 1e-3  # one call per event pair
    assert r["queued"] and r["unqueued_seconds"] == 1e-3 and r["launch_s"] >= 0 and a.note is None
    q_shape, k_shape = fake.shapes[-1]
    assert q_shape == (1, 32, 1, 64) and k_shape == (1, 8 if has_gqa else 32, 1024, 64)
    assert a.to_dict()["cases"][0]["seconds"] == seconds
    a.seconds(8, 4, 64, 1024, batch=16)  # batched decode: a query per sequence, the same B of caches
    q_shape, k_shape = fake.shapes[-1]
    assert q_shape == (16, 32, 1, 64) and k_shape == (16, 8 if has_gqa else 32, 1024, 64)
    assert [c["batch"] for c in a.to_dict()["cases"]] == [1, 16]


@pytest.mark.parametrize("flush_bytes", [0, 1 << 20])
def test_sdpa_anchor_flushes_the_l2_before_each_call(monkeypatch, flush_bytes):
    """With flush_bytes, a read of that buffer is enqueued before every SDPA call whose launch
    or GPU time is taken, outside its events — the samples stay one call each — and Anchor.l2_flush gives
    our side the same read, waited for; with 0, none on either side."""
    fake = _FakeTorch(True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    a = torch_anchor.Anchor(calls=5, flush_bytes=flush_bytes)
    assert a.seconds(8, 4, 64, 1024) == 1e-3 and a.results[(8, 4, 64, 1024, 1)]["samples"] == [1e-3] * 5
    assert a.info["l2_flush_bytes"] == flush_bytes
    if not flush_bytes:
        assert fake.flushes == [] and a.l2_flush is None
        return
    calls_before = [n for kind, n in fake.flushes if kind == "read"]
    # one read ahead of each call whose launch or GPU time is taken (not the clock warm-up's)
    assert len(calls_before) == torch_anchor.WARMUP + 2 * 5
    assert calls_before == list(range(calls_before[0], calls_before[0] + len(calls_before)))
    fake.asleep, n = True, len(fake.flushes)
    a.l2_flush()
    assert fake.flushes[n:] == [("read", fake.calls)] and not fake.asleep  # enqueued, then waited for


def test_interleaved_calls_before_outside_the_timing():
    order = []
    seconds, _ = common.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 2,
                                    before=lambda: order.append("flush"))
    assert order == ["flush", "a", "flush", "b"] * 2 and len(seconds["a"]) == len(seconds["b"]) == 2


def test_sdpa_anchor_says_when_calls_were_not_queued(monkeypatch):
    """Without torch.cuda._sleep the calls cannot be held back: still timed, marked unqueued."""
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch(True, has_sleep=False))
    a = torch_anchor.Anchor(calls=5)
    assert a.seconds(8, 4, 64, 1024) == 1e-3
    assert a.results[(8, 4, 64, 1024, 1)]["queued"] is False
    assert a.to_dict()["cases"][0]["queued"] is False and "could not be queued" in a.to_dict()["note"]


def test_device_anchors_with_and_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch(True))
    a = torch_anchor.device_anchors(1 << 20)
    assert a["available"] and a["cuda_tiny_kernel_sync_us"] > 0
    assert a["torch_copy_bytes_per_s"] == pytest.approx(2 * (1 << 20) / 1e-3)  # one "ms" per copy
    monkeypatch.setitem(sys.modules, "torch", None)
    a = torch_anchor.device_anchors(1 << 20)
    assert not a["available"] and a["cuda_tiny_kernel_sync_us"] is None and "not installed" in a["note"]


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


def test_engine_paths_only_drops_the_forced_paths():
    """attention --engine-paths-only: each cache's own mode (and the KIVI and reconstruct
    modes) without the forced attend_direct / table modes beside them."""
    names = ("f16", "f32", "q8_0", "kivi", "k4v3")
    arenas = {n: object() for n in names}  # never asked anything with the flag
    args = attention.parse_args(["--formats", "4/3", "--engine-paths-only"])
    modes = attention._modes(arenas, args, n_heads=4)
    assert set(modes) == {"f16_cache", "f32_cache", "q8_0_cache", "kivi_cache", "dict_k4v3", "recon_k4v3"}
    assert all(path is None for _, _, _, path, _ in modes.values())


@pytest.mark.gpu
def test_attention_batches_give_batch_rows(tmp_path, restore_env, vk_device):
    """attention --batches: one row per (mode, B) with ``batch`` = B and n_used per sequence,
    the f16 / q8_0 / KIVI caches and each dict format (the kernel named), bytes for B sequences."""
    out = tmp_path / "a.json"
    assert attention.main(["--n-used", "256", "--batches", "2", "--batch-n-used", "200", "--shapes", "2x2",
                           "--head-dims", "32", "--formats", "4/3", "--no-sdpa", "--repeats", "3", "--no-reconstruct",
                           "--engine-paths-only", "--device", vk_device.name, "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["batch"] == 2]
    assert {r["cache"] for r in rows} == {"f16", "q8_0", "kivi", "dict"} and all(r["n_used"] == 200 for r in rows)
    assert all(r["path"] == "flash" for r in rows) and all(r["gpu_s"] is None or r["gpu_s"] > 0 for r in rows)
    f16 = next(r for r in rows if r["cache"] == "f16")
    assert f16["bytes_by_part"]["cache"] == 2 * 2 * 200 * 2 * 16 * 4  # B × n_kv × tokens × (K, V) × f16 words
    kivi = next(r for r in rows if r["cache"] == "kivi")
    assert kivi["variant"].startswith("attend_flash_kivi") and kivi["path"] == "flash"
    coded = next(r for r in rows if r["cache"] == "dict")
    assert coded["kernel"] == "float" and coded["local"] > 0 and coded["heads"] >= 1 and coded["n_splits"] >= 1


def test_attention_takes_captured_code_words(tmp_path, restore_env, vk_device, capsys):
    """attention --codes: the dict slots carry the captured code words (tiled over tokens and KV
    heads; here every V code word on two atoms, the crowded case the value weights' hand-over
    meets), every path over them agrees, the config names the file; a capture of another atom
    count is refused with the reason."""
    from kvdict_vk import codec, synthetic
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 64, (3, 50, 4))
    k_codes = codec.pack_codes(idx, rng.standard_normal(idx.shape))
    v_codes = codec.pack_codes(np.where(idx % 2 == 0, 5, 37), rng.standard_normal(idx.shape))
    path = tmp_path / "codes.npz"
    np.savez(path, k_codes=k_codes, v_codes=v_codes, n_atoms=64)
    slots = synthetic.with_code_words(np.zeros((4, 120, 9), np.uint32), v_codes)
    assert (slots[3, 110, :4] == v_codes[0, 10]).all() and (slots[..., 4:] == 0).all()
    out = tmp_path / "a.json"
    argv = ["--n-used", "100", "--shapes", "2x2", "--head-dims", "32", "--formats", "4/3", "--n-atoms", "64",
            "--sparsity", "4", "--no-sdpa", "--repeats", "3", "--device", vk_device.name, "--out", str(out)]
    from kvdict_vk.vk.attend import tune as attend_tune
    assert attention.main(argv + ["--codes", str(path), "--tune-flush-mib", "1"]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["codes"] == str(path) and result["config"]["tune_flush_mib"] == 1
    assert attend_tune.FLUSH_BYTES == 0  # the run's setting does not outlive it
    checks = result["cases"][0]["by_n_used"][0]["checks"]
    coded = {k: v for k, v in checks.items() if k.startswith(("dict_", "recon_"))}
    assert coded and all(v <= 1e-9 for v in coded.values()), coded
    np.savez(path, k_codes=k_codes, v_codes=v_codes, n_atoms=128)
    with pytest.raises(SystemExit) as e:
        attention.main(argv + ["--codes", str(path)])
    assert e.value.code == 2 and "128 atoms" in capsys.readouterr().err


def test_our_flush_in_the_submission_takes_torchs_place_before_our_recordings():
    """--our-flush submission / primed: our recordings carry the L2 flush in their own
    submission (its bytes from --l2-flush-mib; primed: the passes once ahead of it) and
    torch's flush runs before the other candidates only; 'torch' flushes before every
    candidate; without torch's flush, nothing flushes and nothing is primed."""
    with_torch = types.SimpleNamespace(l2_flush=lambda: None)
    without = types.SimpleNamespace(l2_flush=None)
    rec = types.SimpleNamespace(gpu_seconds=lambda: None, run=lambda: None)  # a Recording, to timing
    candidates = {"ours": rec, "host": lambda: None}
    args = types.SimpleNamespace(l2_flush_mib=256, our_flush="submission")
    assert attention.our_flush_bytes(args, with_torch) == 256 << 20
    assert attention.flush_before(candidates, args, with_torch) == {"host": with_torch.l2_flush}
    assert attention.our_flush_bytes(args, without) == 0 and attention.flush_before(candidates, args, without) is None
    assert attention.our_recording_args(args, with_torch) == {"flush_bytes": 256 << 20, "primed": False}
    args.our_flush = "primed"  # as 'submission', and the passes once ahead of the flush
    assert attention.our_recording_args(args, with_torch) == {"flush_bytes": 256 << 20, "primed": True}
    assert attention.flush_before(candidates, args, with_torch) == {"host": with_torch.l2_flush}
    assert attention.our_recording_args(args, without) == {"flush_bytes": 0, "primed": False}
    args.our_flush = "torch"
    assert attention.our_flush_bytes(args, with_torch) == 0
    assert attention.our_recording_args(args, with_torch) == {"flush_bytes": 0, "primed": False}
    assert attention.flush_before(candidates, args, with_torch) is with_torch.l2_flush
    seen = []
    common.interleaved({"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}, 2,
                       before={"b": lambda: seen.append("flush")})
    assert seen == ["a", "flush", "b", "a", "flush", "b"]


@pytest.mark.gpu
def test_decode_step_benchmark_times_the_recorded_step_beside_the_per_layer_one(tmp_path, restore_env, vk_device):
    """kvdict_vk.bench.decode_step on a tiny model: a case per (shape, cache, context), each
    candidate timed every token, the recorded step's GPU time within its wall time and its
    host time what is left; the JSON and the report written."""
    from kvdict_vk.bench import decode_step
    out = tmp_path / "decode_step.json"
    assert decode_step.main(["--shapes", "2x2x2x64", "--contexts", "40", "--caches", "f16,q8_0", "--tokens", "2",
                             "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(c["cache"], c["n_ctx"], c["layers"]) for c in result["cases"]] == [("f16", 40, 2), ("q8_0", 40, 2)]
    for c in result["cases"]:
        for name in ("recorded", "recorded_at_length", "recorded_in_place", "per_layer_step"):
            assert len(c[name]["wall_s"]["samples"]) == 2
        rec = c["recorded"]
        if "gpu_s" in rec:  # a device with timestamps
            for wall, gpu, sub, host in zip(*(rec[k]["samples"] for k in ("wall_s", "gpu_s", "submitted_gpu_s",
                                                                            "host_s"))):
                assert 0 < gpu <= sub <= wall and host == pytest.approx(wall - sub)
        assert c["host_budget_us"] == 54.0
