"""kvdict-demo's device choice and its report: the device it ran on and how to pick
another; the certified ΔPPL said once; the decode check's verdict. (`make demo` runs the
whole job.)"""
from __future__ import annotations

import pytest

from kvdict_vk.cli import demo


def _report(reproduces: bool = True) -> dict:
    nll = dict(max_abs_nll_diff=3.8e-5, mean_abs_nll_diff=4.4e-6, worst_token=42)
    return dict(
        device="llvmpipe (LLVM 15.0.6, 256 bits)", device_chosen_by="the embedded default",
        devices=["0: llvmpipe (LLVM 15.0.6, 256 bits)", "1: NVIDIA H200"], artifact="out/forge/smollm2.q42art",
        certified=dict(delta_ppl=0.0064, ci95=[0.0019, 0.0109], baseline_ppl=19.82, coded_ppl=19.95,
                       eval_tokens=7161, threshold=0.01, worst_text="pydoc",
                       texts={"gpl3": [0.0010, 0.0090], "pydoc": [0.0019, 0.0099]}),
        decode=dict(tokens=256, reproduces_cpu_path=reproduces, step_nmse_tolerance=1e-9, nll_tolerance_nats=1e-3,
                    f32=dict(steps=7680, worst_step_nmse=2e-14, nll_vs_cpu_forward=nll, tokens_per_s=5.1,
                             variant="attend_direct"),
                    dict=dict(steps=7680, worst_step_nmse=3e-13, tokens_per_s=4.9, variant="attend_split_coded")),
        memory=dict(f32_bytes_per_token=46080, dict_bytes_per_token=9360, compression_vs_f32=4.92,
                    compression_vs_f16=2.46, dictionary_tail_bytes=47278080),
        validation=dict(cases=27, passed=27, worst_nmse=1e-14, worst_encoder_rel_err_diff=0.001),
        seconds=321.0)


def test_report_says_the_certified_delta_ppl_once_and_what_the_decode_verified():
    text = demo.format_report(_report())
    assert text.count("ΔPPL") == 1 and "+0.64 %" in text and "+0.19 … +1.09 %" in text
    assert "reproduce the CPU path" in text and "15360 (layer, token) steps" in text and "twice" in text
    assert "max |Δ| 3.8e-05 ≤ 0.001 nats" in text
    assert "f32 attend_direct, dict attend_split_coded" in text  # the kernels the decodes ran on
    assert "worst of its texts (pydoc)" in text and "gpl3 [+0.10, +0.90] %" in text and "on every text" in text
    first = text.splitlines()[0]
    assert "llvmpipe" in first and "the embedded default" in first
    assert "KVDICT_VK_DEVICE=<index|name>" in first and "1: NVIDIA H200" in first
    assert "DO NOT reproduce" in demo.format_report(_report(reproduces=False))


def test_report_ranks_the_gated_caches_and_says_why_the_winner_won():
    r = _report()
    ranked = dict(n_ctx=8192, threshold=0.01, winner="KIVI 4 bit + 128 recent", winner_kind="kivi",
                  reason="the smallest whole arena at 8192 tokens (59.8 MiB) among the caches that pass the gate; "
                         "not a dictionary — the dictionary cache stays a certified option",
                  rows=[dict(name="KIVI 4 bit + 128 recent", passes=True, arena_bytes=int(59.8 * 2 ** 20),
                             worst_text="gpl3", worst_delta_ppl=0.0038, worst_upper=0.006),
                        dict(name="q8_0", passes=False, arena_bytes=int(95.6 * 2 ** 20), worst_text="pydoc",
                             worst_delta_ppl=0.02, worst_upper=0.03)])
    r["ranking"] = ranked
    r["decode"]["winner"] = dict(name="KIVI 4 bit + 128 recent", cache="kivi", steps=7680, worst_step_nmse=4e-14,
                                 tokens_per_s=4.0, variant="attend_flash_kivi")
    text = demo.format_report(r)
    assert "1. KIVI 4 bit + 128 recent" in text and "59.8 MiB  passes" in text and "2. q8_0" in text
    assert "FAILS" in text and "upper bound +3.00 %" in text
    assert "winner          KIVI 4 bit + 128 recent: the smallest whole arena" in text and "not a dictionary" in text
    assert "winner decode   KIVI 4 bit + 128 recent: 7680 (layer, token) steps" in text
    assert "256 tokens three times" in text and "23040 (layer, token) steps" in text and "kivi 4.0e-14" in text
    assert "ranking" not in demo.format_report(_report())  # a report without one says nothing of it


@pytest.mark.gpu
@pytest.mark.parametrize("flag, env, chosen_by", [
    (None, None, "the embedded default"),
    (None, "llvm", "$KVDICT_VK_DEVICE"),
    ("llvmpipe", "no-such-device", "--device"),  # the flag wins over the environment
])
def test_device_choice(vk_device, monkeypatch, flag, env, chosen_by):
    if env is None:
        monkeypatch.delenv("KVDICT_VK_DEVICE", raising=False)
    else:
        monkeypatch.setenv("KVDICT_VK_DEVICE", env)
    args = demo.argparse.Namespace(device=flag)
    dev, how, devices = demo.choose_device(args)
    assert how == chosen_by
    assert "llvmpipe" in dev.name.lower() and any(dev.name in d for d in devices)
