"""Probe attend_flash_coded on a GPU: every launch shape the tuner may pick (query heads per
workgroup, invocations, workgroups) for each SPIR-V build given (directories holding
attend_flash_coded*.spv built with other -D knobs, through $KVDICT_VK_SPV_DIR), by GPU time
of the whole attention (q·atom table, the kernel, the merge), beside attend_flash over the
f16 cache of the same shape and torch SDPA over f16 (when torch with CUDA is there).
Every build's output is checked against the first's (NMSE) and, at the first n_used, against
float64. ``--kernels`` names the kernels over the codes to time in each build
(attend.CODED_KERNELS; at a commit that had two, both). ``--l2-flush-mib 256`` times every
shape with the L2 flushed ahead of each timed pass (attend_tune.FLUSH_BYTES: a copy inside each
of the timing's recorded runs, whose best is kept), as the attention benchmark times the
tuner's choice; 0 times back to back, the L2 warm. ``--codes FILE`` times each format over
captured code words too (``4/3+captured``: how real collisions on an atom cost the hand-over).
``--configs`` times each build at settings of a branch's integer knobs attend_specs.FLASH_CODED_*
(specialization constants read when a pass is built: one SPIR-V, so the runs differ only there);
``--registers`` adds the driver's statistics (registers) of every attend_flash_coded built
(lab/probes/pipeline_stats.py; the ``vulkan`` package). Writes one JSON file.

  python lab/probes/coded_probe.py --builds default=,tb1=probe_spv/tb1 --out probe.json

Run as ``python lab/probes/coded_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from kvdict_vk.bench import attention as BA, common, torch_anchor
from kvdict_vk import attention_ref
from kvdict_vk.metrics import nmse
from kvdict_vk.vk import KvArena, spirv
from kvdict_vk.vk.attend import engine as A
from kvdict_vk.vk.attend import specs as S
from kvdict_vk.vk.attend import tune as T


def timed(att, n, plan, rounds=3):
    """The best GPU time of ``rounds`` timings of ``plan`` (each the best of the tuner's repeats,
    each repeat after attend_tune.FLUSH_BYTES of L2 flush where that is set)."""
    best = None
    for _ in range(rounds):
        t = att.time_plan(0, n, plan)
        best = t if best is None or (t is not None and t < best) else best
    return best


def warm(att, n, plan, seconds=0.3):
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        att.time_plan(0, n, plan)


def registers(run, device_name: str) -> list[dict]:
    """Run ``run()`` and return the driver's statistics of every attend_flash_coded it built,
    per build (pipeline_stats: its SPIR-V directory, specialization, registers)."""
    import pipeline_stats as PS
    found = PS.record_kernels(run, "attend_flash_coded")
    stats_dev = PS.StatsDevice(device_name)
    try:
        for k in found:
            if k["spv_dir"]:
                os.environ[spirv.SPV_DIR_ENV] = k["spv_dir"]
            else:
                os.environ.pop(spirv.SPV_DIR_ENV, None)
            k["executables"] = stats_dev.statistics(k)
            brief = {n: v for e in (k["executables"] or []) for n, v in e["statistics"].items() if "egister" in n}
            print(f"[registers] {k['spv_dir'] or '-'} {k['spec']} {brief}", flush=True)
    finally:
        stats_dev.close()
        os.environ.pop(spirv.SPV_DIR_ENV, None)
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", default="default=", help="name=spv dir (empty: the package's), comma-separated")
    ap.add_argument("--shapes", default="8x4,3x3")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--n-used", default="32768,131072")
    ap.add_argument("--formats", default="4/3,0/0")
    ap.add_argument("--sparsity", type=int, default=None,
                    help="code words a slot (default: the attention benchmark's gpu preset's, the certified format's)")
    ap.add_argument("--codes", default="", help="an .npz of captured code words (lab/probes/atom_usage.py --save-codes): "
                    "each format is timed over them too, as FORMAT+captured, beside uniformly random ones")
    ap.add_argument("--l2-flush-mib", type=int, default=0,
                    help="copy this many MiB ahead of every timed pass (attend_tune.FLUSH_BYTES; the attention "
                         "benchmark reads 256 through torch before every call; 0: back to back, the L2 warm)")
    ap.add_argument("--workgroups", default="132,264,528,1056")
    ap.add_argument("--configs", default="", help="integer settings attend_specs.FLASH_CODED_<KEY> to time each "
                    "build at (a branch's knobs, read when a pass is built): NAME:KEY=V+KEY=V,... (run BUILD@NAME, "
                    "the other settings as shipped; empty: the package's)")
    ap.add_argument("--kernels", default="float", help="kernels over the codes to time (attend.CODED_KERNELS), comma-separated")
    ap.add_argument("--registers", action="store_true",
                    help="also read the driver's statistics (registers) of every attend_flash_coded built "
                         "(lab/probes/pipeline_stats.py's device; the vulkan package)")
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    builds = [tuple(b.split("=", 1)) for b in a.builds.split(",")]
    configs = [("", {})]
    if a.configs:
        configs = [(c.split(":", 1)[0], {"FLASH_CODED_" + k: int(v) for k, v in
                                         (kv.split("=") for kv in c.split(":", 1)[1].split("+"))})
                   for c in a.configs.split(",")]
    shipped = {k: getattr(S, k, None) for c in configs for k in c[1]}
    for key, value in shipped.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise SystemExit(f"--configs: attend_specs.{key} is not an integer knob here (it is {value!r})")
    out_configs = {name: config for name, config in configs}
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    anchor = torch_anchor.Anchor(50, enabled=True)
    # A flush through torch before each timing would leave the L2 warm for all but the first of
    # time_plan's repeats, whose best is kept: the flush belongs inside each repeat.
    T.FLUSH_BYTES = a.l2_flush_mib << 20
    out = {"argv": sys.argv, "device": dev.name, "builds": dict(builds), "configs": out_configs,
           "l2_flush_mib": a.l2_flush_mib, "cases": []}

    def body():
        rng = np.random.default_rng(0)
        ns = [int(x) for x in a.n_used.split(",")]
        # the bench's gpu preset dictionaries, uniform code words (and captured ones with --codes)
        sources = [("", None)]
        if a.codes:
            preset = BA.dict_args()
            sources.append(("+captured", BA.load_codes(a.codes, preset.n_atoms, a.sparsity or preset.sparsity)))
        for shape in a.shapes.split(","):
            n_kv, gqa = common.dims(shape)
            for hd in (int(x) for x in a.head_dims.split(",")):
                q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
                f16 = KvArena(1, n_kv, hd, max(ns), device=dev, cache="f16")
                rows = BA.random_rows(rng, n_kv, max(ns), hd)
                f16.append(0, rows, rows)
                f16_att = f16.attention(n_kv * gqa)
                for n in ns:
                    plan = f16_att.plan(0, n)
                    warm(f16_att, n, plan)
                    case = {"shape": shape, "head_dim": hd, "n_used": n, "f16_flash_s": timed(f16_att, n, plan, 5),
                            "f16_plan": vars(plan), "torch_sdpa_f16_s": anchor.seconds(n_kv, gqa, hd, n), "formats": {}}
                    out["cases"].append(case)
                f16.free()
                for (fmt_name, codes), fmt in ((src, f) for f in a.formats.split(",") for src in sources):
                    bits = tuple(int(b) for b in fmt.split("/"))
                    bargs = BA.dict_args(code_words=codes)  # the benchmark's gpu preset dictionaries
                    bargs.sparsity = a.sparsity or bargs.sparsity
                    arena, dicts, slots = BA.dict_arena(bits, n_kv, hd, max(ns), bargs, dev, rng)
                    fmt = fmt + fmt_name
                    first, ref = {}, None
                    for (name, spv_dir), kernel, (cname, config) in ((b, k, c) for b in builds
                                                                     for k in a.kernels.split(",") for c in configs):
                        for key, value in shipped.items():  # read when the attention builds its passes
                            setattr(S, key, config.get(key, value))
                        if spv_dir:
                            os.environ[spirv.SPV_DIR_ENV] = os.path.abspath(spv_dir)
                        else:
                            os.environ.pop(spirv.SPV_DIR_ENV, None)
                        run_name = (name if kernel == "float" else f"{name}:{kernel}") + (f"@{cname}" if cname else "")
                        att = A.Attention(arena.memory, n_kv * gqa)
                        att.path, att.coded_kernel = "flash", kernel
                        try:
                            for n in ns:
                                case = next(c for c in out["cases"] if (c["shape"], c["head_dim"], c["n_used"]) == (shape, hd, n))
                                res = case["formats"].setdefault(fmt, {}).setdefault(run_name, {"shapes": []})
                                check = att.attend(0, q, n, 1.0 / np.sqrt(hd))
                                first.setdefault(n, check)
                                if n == ns[0]:  # the float64 reference, once per format, against every run
                                    if ref is None:
                                        ref = attention_ref.attend_coded(q.astype(np.float64), slots[0], slots[1], dicts[0],
                                                                         dicts[1], n, 1.0 / np.sqrt(hd))
                                    res["nmse_vs_float64"] = float(nmse(ref, check))
                                res["nmse_vs_first_build"] = float(nmse(first[n].astype(np.float64), check))
                                shapes = [T.Shape(local, wg, hb, kernel) for hb, locals_ in att.shapes.flash_coded_options(0, kernel)
                                          for local in locals_ for wg in (int(w) for w in a.workgroups.split(","))]
                                warm(att, n, att.shapes.flash_shaped(n, shapes[0]))
                                for sh in shapes:
                                    plan = att.shapes.flash_shaped(n, sh)
                                    res["shapes"].append({"heads": sh.heads, "local": sh.local, "workgroups": sh.workgroups,
                                                          "n_splits": plan.n_splits, "gpu_s": timed(att, n, plan)})
                                best = min(res["shapes"], key=lambda r: r["gpu_s"] or 1e9)
                                res["best"] = best
                                print(f"{shape} d{hd} n{n} {fmt} {run_name}: best {best['gpu_s'] * 1e6:.1f} us "
                                      f"(hb {best['heads']} local {best['local']} wg {best['workgroups']}), "
                                      f"f16 {case['f16_flash_s'] * 1e6:.1f} us, sdpa "
                                      f"{(case['torch_sdpa_f16_s'] or 0) * 1e6:.1f} us, nmse {res['nmse_vs_first_build']:.2g} "
                                      f"(float64: {res.get('nmse_vs_float64')})",
                                      flush=True)
                        finally:
                            att.free()
                    arena.free()
                with open(a.out, "w") as f:
                    json.dump(out, f, indent=1)

    if a.registers:  # the driver's statistics of every attend_flash_coded built, per build
        out["kernels"] = registers(body, dev.name)
    else:
        body()
    os.environ.pop(spirv.SPV_DIR_ENV, None)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
