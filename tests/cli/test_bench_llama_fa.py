"""kvdict-bench llama_fa (llama.cpp's Vulkan flash attention as an anchor), against a stand-in
for test-backend-ops that prints what the real one prints (its SQL result line, ggml-vulkan's
perf-logger lines): rows named as the attention benchmark's cases with the logger's GPU
means (the warm-up graph left out) and test-backend-ops' own wall time; the -p filter picks
exactly one of the real binary's cases; unsupported cases give no row; a failing binary is a
typed, one-line failure; no binary is a skip, in a run and in --resummarize. No device needed.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import textwrap

import pytest

from kvdict_vk import errors as E
from kvdict_vk.bench import llama_fa
from kvdict_vk.cli import bench

# test-backend-ops' vars() string of one added decode case, as the H200 run printed it
REAL_PARAMS = ("hsk=64,hsv=64,nh=8,nr23=[4,1],kv=32768,nb=1,mask=0,sinks=0,max_bias=0.000000,"
               "logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=0,"
               "v_is_view_of_k=0,n_kv_max=0")

# The stand-in: the case from -p, GPU means of (kv / 1024) µs (three times that with ggml's
# cooperative-matrix and integer-dot switches off) plus 0.1 µs per graph after a 1000 µs
# warm-up graph, time_us twice the first timed mean; $FAKE_UNSUPPORTED names a type it
# reports unsupported, $FAKE_EXIT an exit status.
FAKE = textwrap.dedent('''\
    import os, re, sys
    argv = sys.argv[1:]
    assert argv[:3] == ["perf", "-b", "Vulkan0"] and argv[argv.index("-o") + 1] == "FLASH_ATTN_EXT"
    assert argv[-2:] == ["--output", "sql"] and os.environ.get("GGML_VK_PERF_LOGGER") == "1"
    p = argv[argv.index("-p") + 1]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(p + "\\n")
    if os.environ.get("FAKE_EXIT"):
        print("ggml_vulkan: no device", file=sys.stderr)
        sys.exit(int(os.environ["FAKE_EXIT"]))
    d, nh, kv, t = (re.search(k + r"=\\\\?\\[?(\\w+)", p).group(1) for k in ("hsk", "nh", "kv", "type_K"))
    kv = int(kv)
    scalar = all(os.environ.get("GGML_VK_DISABLE_" + f) for f in ("COOPMAT", "COOPMAT2", "INTEGER_DOT_PRODUCT"))
    cores = "none" if scalar else "NV_coopmat2"
    print(f"ggml_vulkan: 0 = Fake GPU (Fake) | int dot: {int(not scalar)} | matrix cores: {cores}", file=sys.stderr)
    means = [1000.0] + [(3 if scalar else 1) * kv / 1024 + 0.1 * i for i in range(5)]
    supported = "0" if t == os.environ.get("FAKE_UNSUPPORTED") else "1"
    if supported == "1":
        for m in means:
            print("----------------\\nVulkan Timings:", file=sys.stderr)
            print(f"FLASH_ATTN_EXT dst({d},9,1,1),  q({d},1,9,1): 7 x {m} us = {7 * m} us (1 GFLOPS/s)",
                  file=sys.stderr)
    params = f"hsk={d},hsv={d},nh={nh},nr23=[3,1],kv={kv},nb=1,mask=0,sinks=0,prec=f32,type_K={t},type_V={t}"
    time_us = 2 * means[1] if supported == "1" else 0
    print("INSERT INTO test_backend_ops (test_time, build_commit, backend_name, op_name, op_params, "
          "test_mode, supported, passed, time_us, n_runs, device_description) VALUES ('2026-12-04T00:00:00Z', "
          f"'abc1234', 'Vulkan0', 'FLASH_ATTN_EXT', '{params}', 'perf', '{supported}', '1', '{time_us}', "
          "'99', 'Fake GPU');")
''')


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    path = tmp_path / "test-backend-ops"
    path.write_text(f"#!{sys.executable}\n" + FAKE)
    path.chmod(0o755)
    log = tmp_path / "filters.log"
    monkeypatch.setenv(llama_fa.ENV_BIN, str(path))
    monkeypatch.setenv("FAKE_LOG", str(log))
    for name in ("FAKE_UNSUPPORTED", "FAKE_EXIT"):
        monkeypatch.delenv(name, raising=False)
    return log


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def test_rows_carry_the_logger_means_and_the_binarys_wall_time(tmp_path, fake_bin):
    out = tmp_path / "r"
    assert bench.main(["llama_fa", "--quick", "--repeats", "2", "--out-dir", str(out)]) == 0
    summary = _summary(out)
    rows = [r for r in summary["rows"] if r["benchmark"] == "llama_fa"]
    assert [r["case"] for r in rows] == ["f16 3x3 d64 n1024", "q8_0 3x3 d64 n1024",
                                        "f16 3x3 d64 n4096", "q8_0 3x3 d64 n4096"]
    for r in rows:
        per_graph = [r["n_used"] / 1024 + 0.1 * i for i in range(5)]  # the warm-up graph left out
        assert r["gpu_s"] == pytest.approx(1e-6 * statistics.median(per_graph + per_graph))
        assert r["wall_s"] == pytest.approx(2e-6 * r["n_used"] / 1024)
        row_bytes = 128 if r["cache"] == "f16" else 68  # 64 halves; two q8_0 blocks of 34 B
        assert r["bytes"] == 2 * 3 * r["n_used"] * row_bytes
        assert (r["n_kv"], r["gqa"], r["head_dim"], r["batch"]) == (3, 3, 64, 1)
    (fig,) = summary["benchmarks"]["llama_fa"]["headline"]
    assert fig["case"] == "f16 3x3 d64 n4096" and fig["ratio"] == pytest.approx(fig["numerator"] / fig["denominator"])
    filters = fake_bin.read_text().splitlines()
    assert len(filters) == 8  # 4 cases x 2 repeats, one process each
    raw = json.loads((out / "llama_fa.json").read_text())
    assert raw["build_commit"] == "abc1234" and raw["device_description"] == "Fake GPU"
    assert raw["vulkan_device"] == "Fake GPU (Fake) | int dot: 1 | matrix cores: NV_coopmat2"


def test_the_filter_picks_exactly_one_real_case():
    assert re.match(llama_fa.params_regex("f16", 8, 4, 64, 32768), REAL_PARAMS)
    for other in (("q8_0", 8, 4, 64, 32768), ("f16", 8, 4, 64, 3276), ("f16", 8, 4, 128, 32768),
                  ("f16", 3, 3, 64, 32768), ("f16", 8, 4, 64, 327680)):
        assert not re.match(llama_fa.params_regex(*other), REAL_PARAMS), other
    assert not re.match(llama_fa.params_regex("f16", 8, 4, 64, 32768), REAL_PARAMS.replace("mask=0", "mask=1"))


def test_an_unsupported_case_gives_no_row(tmp_path, fake_bin, monkeypatch):
    monkeypatch.setenv("FAKE_UNSUPPORTED", "q8_0")
    assert bench.main(["llama_fa", "--quick", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    assert [r["cache"] for r in _summary(tmp_path)["rows"]] == ["f16", "f16"]


def test_a_failing_binary_fails_the_entry_in_one_line(tmp_path, fake_bin, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_EXIT", "3")
    assert bench.main(["llama_fa", "--quick", "--out-dir", str(tmp_path)]) == 1
    failed = _summary(tmp_path)["benchmarks"]["llama_fa"]["failed"]
    assert failed.startswith("AnchorError: ") and "exited 3" in failed and "no device" in failed
    assert "Traceback" not in capsys.readouterr().err  # a refused run, not a bug


@pytest.mark.parametrize("text", ["", "INSERT INTO test_backend_ops (op_name, test_mode) VALUES ('ADD', 'perf');",
                                  "INSERT INTO test_backend_ops (op_name, test_mode, supported) "
                                  "VALUES ('FLASH_ATTN_EXT', 'perf', '1');"])
def test_output_without_one_timed_result_is_refused(text):
    with pytest.raises(E.AnchorError):
        llama_fa.parse_output(text)


def test_no_binary_skips_in_a_run_and_in_resummarize(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(llama_fa.ENV_BIN, raising=False)
    assert bench.main(["llama_fa", "--out-dir", str(tmp_path)]) == 0
    assert "test-backend-ops" in _summary(tmp_path)["benchmarks"]["llama_fa"]["skipped"]
    assert bench.main(["llama_fa", "--out-dir", str(tmp_path), "--resummarize"]) == 0
    assert "no " in _summary(tmp_path)["benchmarks"]["llama_fa"]["skipped"]
    assert "llama_fa: skipped" in capsys.readouterr().err
    args = llama_fa.parse_args(["--out", str(tmp_path / "x.json")])
    with pytest.raises(E.AnchorError, match="test-backend-ops"):
        llama_fa.run(args, print)


def test_the_scalar_path_runs_with_ggmls_switches_off(tmp_path, fake_bin):
    args = llama_fa.parse_args(["--shapes", "3x3", "--head-dims", "64", "--n-used", "1024", "--types", "f16",
                                "--paths", "default,scalar", "--repeats", "1", "--out", str(tmp_path / "x.json")])
    result = llama_fa.run(args, lambda line: None)
    default, scalar = result["rows"]
    assert (default["case"], scalar["case"]) == ("f16 3x3 d64 n1024", "f16 scalar 3x3 d64 n1024")
    assert default["gpu_s"] == pytest.approx(1.2e-6) and scalar["gpu_s"] == pytest.approx(3.2e-6)
    assert [c["runs"][0]["vulkan_device"].endswith(cores) for c, cores in
            zip(result["cases"], ("NV_coopmat2", "none"))] == [True, True]
    with pytest.raises(SystemExit):
        llama_fa.parse_args(["--paths", "coopmat9"])


def test_the_anchor_build_adds_every_case_a_preset_times():
    built = llama_fa.decode_cases()  # what tools/build_llama_anchor.sh writes into test-backend-ops
    assert len(built) == len(set(built))
    for preset in llama_fa.PRESETS.values():
        assert set(llama_fa.case_shapes(llama_fa.parse_args(preset))) <= set(built)
    assert ("q4_0", 8, 4, 128, 131072) in built and ("f16", 3, 3, 64, 1024) in built
