"""Everything about this installation that a bug report or a benchmark needs, in one place
(wgpu-py's ``print_report()`` is the model):

* **host** — OS, Python, CPU model and count;
* **versions** — kvdict_vk, NumPy, Kompute (``kp``) with whether it carries this project's
  patch (scripts/kp_patch.py) and which one (the hash scripts/setup.sh records in the
  venv's ``.kp-build-opts``), the Vulkan loader and the chosen device's driver;
* **devices** — every Vulkan device the loader reports (kvdict_vk.vk.vulkan_info), its
  limits and the optional features the kernels pick variants by (subgroup size and
  operations, timestamps, multiprocessors), and which one ``$KVDICT_VK_DEVICE`` selects;
* **artifact** — the runtime's installed dictionaries and their certificate
  (kvdict_vk.runtime);
* **tuner_cache** — the measured-choice store (``$KVDICT_VK_TUNE_CACHE``,
  kvdict_vk.vk.choice_store): its path and entries by kind;
* **spirv** — the shipped SPIR-V's manifest: variant count, missing ones and, in a
  checkout, the stale ones (kvdict_vk.vk.shader_build.stale).

``report()`` returns them as one JSON-ready dict; ``print_report()`` prints them.
``kvdict-validate --report`` prints the report, ``--list`` the device lines; the benchmarks'
JSON header (bench.common.run_header) and the test session's header take their parts here.
Nothing here opens a device: the loader is asked through a short-lived instance of its own,
and kp is imported, never started. A section that cannot be read says why (``error``)
instead of raising.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT = PACKAGE_DIR.parent  # a source tree's root (scripts/, shaders/ beside the package)
KP_BUILD_OPTS = ".kp-build-opts"  # scripts/setup.sh writes the kp build's options into the venv
SECTIONS = ("host", "versions", "devices", "artifact", "tuner_cache", "spirv")


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- host and versions ----------------------------------------------------------------------

def host() -> dict:
    """OS, machine, Python, CPU model and count, load average (where the OS has one)."""
    from .vk.choice_store import host_cpu  # reads /proc/cpuinfo; no Vulkan
    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": f"{platform.python_version()} ({platform.python_implementation()})",
            "cpu": host_cpu(), "cpus": os.cpu_count(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def kp_info() -> dict:
    """Kompute: its version, whether the imported build carries this project's patch (the
    bindings the patch adds), the patch hash it was built with (the venv's .kp-build-opts,
    where scripts/setup.sh built it) and, in a checkout, whether that is today's
    scripts/kp_patch.py."""
    out = {"version": _dist_version("kp"), "patched": None, "build_opts": None, "patch_hash": None,
           "checkout_patch_hash": None, "patch_current": None}
    try:
        import kp
        out["patched"] = hasattr(kp, "OpComputeBarrier") and hasattr(kp.Sequence, "record_unlatched")
    except ImportError as e:
        out["error"] = f"ImportError: {e}"
    opts = Path(sys.prefix) / KP_BUILD_OPTS
    if opts.is_file():
        out["build_opts"] = opts.read_text().strip()
        words = dict(w.split("=", 1) for w in out["build_opts"].split() if "=" in w)
        out["patch_hash"] = words.get("kp_patch")
    patch = CHECKOUT / "scripts" / "kp_patch.py"
    if patch.is_file():  # setup.sh's hash: sha256sum scripts/kp_patch.py | cut -c1-12
        out["checkout_patch_hash"] = hashlib.sha256(patch.read_bytes()).hexdigest()[:12]
        if out["patch_hash"] is not None:
            out["patch_current"] = out["patch_hash"] == out["checkout_patch_hash"]
    return out


def torch_info(torch=None) -> dict:
    """torch's version and CUDA (the benchmarks' SDPA anchor): from the module where the
    caller has it imported (then with its CUDA device's name), else from the installed
    distribution's metadata — torch is not imported here."""
    if torch is None:
        return {"torch": _dist_version("torch")}
    out = {"torch": getattr(torch, "__version__", None),
           "cuda": getattr(getattr(torch, "version", None), "cuda", None)}
    try:
        out["cuda_device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # no CUDA device: the version still says what is installed
        out["cuda_device"] = None
        out["cuda_error"] = f"{type(e).__name__}: {e}"
    return out


def versions(devices_: list | None = None) -> dict:
    """kvdict_vk, NumPy, kp (kp_info), torch's distribution where installed, and the driver of
    the device ``$KVDICT_VK_DEVICE`` selects (from ``devices_``, a devices() list, when given)."""
    import numpy as np
    out = {"kvdict_vk": _dist_version("kvdict_vk"), "numpy": np.__version__, "kp": kp_info(),
           "torch": _dist_version("torch")}
    if devices_ is None:
        try:
            devices_ = devices()
        except Exception:  # no loader: no driver to name
            devices_ = []
    devs = devices_
    chosen = [d for d in devs if isinstance(d, dict) and d.get("selected")]
    out["driver"] = driver_line(chosen[0]) if chosen else None
    return out


# --- devices --------------------------------------------------------------------------------

def features(info) -> dict:
    """The optional features a DeviceInfo reports that the kernels choose variants by: the
    subgroup size and operation classes of compute shaders (shuffle: the attend_flash_sg
    variants), the optional features beyond Vulkan 1.1 core (abi.FEATURES) it reports and
    those of them kp enables, timestamps (GPU time), and the multiprocessor count (where reported)."""
    from .vk.abi import ENABLED_FEATURES
    lim = info.limits
    ops = tuple(lim.get("subgroup_operations", ()))
    reported = list(lim.get("optional_features", ()))
    return {"subgroup_size": lim.get("subgroup_size", 0), "subgroup_operations": list(ops),
            "optional_reported": reported, "optional_enabled": [f for f in reported if f in ENABLED_FEATURES],
            "subgroup_shuffle": {"basic", "shuffle"} <= set(ops),
            "timestamps": bool(lim.get("timestamp_valid_bits", 0)) and bool(lim.get("timestamp_period_ns", 0)),
            "compute_units": lim.get("compute_units") or None}


def _device_infos() -> tuple[list, int | None]:
    """(DeviceInfo list in loader order, index of the selected one or None). Through
    vk.device where kp imports (its cached query, which the test session shares), else
    straight from the loader."""
    try:
        from .vk import device as vkd
    except ImportError:
        from .vk.vulkan_info import query_devices
        return query_devices(), None
    infos = vkd.list_devices()
    try:
        selected = vkd.select_device().index
    except Exception:  # a $KVDICT_VK_DEVICE naming no device: listed, none selected
        selected = None
    return infos, selected


def device_entry(info, selected: bool | None = None) -> dict:
    """One device as the report and the benchmarks' JSON hold it: DeviceInfo.to_dict() (name,
    type, ids, API and driver, limits, heaps) plus ``features`` (and ``selected`` where known)."""
    d = info.to_dict()
    d["features"] = features(info)
    if selected is not None:
        d["selected"] = selected
    return d


def devices() -> list[dict]:
    """Every Vulkan device (device_entry), in the loader's order — ``kp.Manager(index)``'s.
    Raises what the loader query raises (no loader, no instance)."""
    infos, selected = _device_infos()
    return [device_entry(i, i.index == selected) for i in infos]


def driver_line(d: dict) -> str:
    return f"{d.get('driver_name', '')} {d.get('driver_info', '')}".strip() or f"driver {d.get('driver_version')}"


def device_line(d: dict) -> str:
    """One line per device (kvdict-validate --list): index, name, driver, the limits the
    engine sizes by, subgroup, multiprocessors; ``*`` marks the selected one."""
    lim = d.get("limits", {})
    mark = "*" if d.get("selected") else " "
    return (f"[{d.get('index')}]{mark}{d.get('name')} — {d.get('device_type')}, {driver_line(d)}; "
            f"maxStorageBufferRange {lim.get('max_storage_buffer_range')}, "
            f"maxComputeWorkGroupInvocations {lim.get('max_compute_work_group_invocations')}, "
            f"subgroup {lim.get('subgroup_size')}, multiprocessors {lim.get('compute_units') or 'not reported'}")


# --- artifact, tuner cache, SPIR-V ----------------------------------------------------------

def artifact() -> dict:
    """The runtime's state: the toggle, the installed dictionaries' shape, their certificate
    (None: installed without one), $KVDICT_VK_ARTIFACT and what activating it raised."""
    from . import runtime
    snap = runtime.snapshot()
    art, cert = snap.artifact, snap.cert
    out = {"enabled": snap.enabled, "active": snap.active, "env": os.environ.get(runtime.ENV_ARTIFACT) or None,
           "startup_error": str(runtime.startup_error) if runtime.startup_error else None,
           "installed": None, "certificate": None}
    if art is not None:
        out["installed"] = {"head_dim": art.head_dim, "n_atoms": art.n_atoms, "sparsity": art.sparsity,
                            "layers": len(art.layers)}
    if cert is not None:
        out["certificate"] = {"kind": cert.kind, "passed": cert.passed, "metric": cert.metric,
                              "value": cert.value, "threshold": cert.threshold, "eval_tokens": cert.eval_tokens,
                              "payload_sha256": cert.payload_sha256, "model": dict(cert.model)}
    return out


def tuner_cache() -> dict:
    """$KVDICT_VK_TUNE_CACHE: the file, whether it exists, and its entries by chooser kind
    (kvdict_vk.vk.choice_store's format: {"version", "choices": {json [kind, *key]: …}})."""
    from .vk import choice_store
    where = choice_store.path()
    out = {"env": choice_store.CACHE_ENV, "path": str(where) if where else None,
           "exists": bool(where and where.is_file()), "entries": 0, "by_kind": {}}
    if not out["exists"]:
        return out
    try:
        data = json.loads(where.read_text(encoding="utf-8") or "{}")
        if data and data.get("version") != choice_store.STORE_VERSION:
            out["error"] = f"not a version-{choice_store.STORE_VERSION} choice store (rewritten on the next save)"
            return out
        for key in (data.get("choices") or {}):
            kind = json.loads(key)[0]
            out["by_kind"][kind] = out["by_kind"].get(kind, 0) + 1
        out["entries"] = sum(out["by_kind"].values())
    except (OSError, ValueError, TypeError, IndexError, AttributeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def spirv_manifest() -> dict:
    """The shipped SPIR-V (kvdict_vk/spv): the manifest's variant count, the variants
    shader_build knows and which have no .spv, the override directory ($KVDICT_VK_SPV_DIR)
    and, in a checkout, the stale variants (rebuilt on first use)."""
    from .vk import shader_build, spirv
    spv_dir = shader_build.SPV_DIR
    manifest_path = spv_dir / shader_build.MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    known = list(shader_build.VARIANTS)
    out = {"dir": str(spv_dir), "manifest": str(manifest_path) if manifest_path.is_file() else None,
           "manifest_variants": len(manifest), "variants": len(known),
           "missing": [n for n in known if not (spv_dir / f"{n}.spv").is_file()],
           "override_dir": os.environ.get(spirv.SPV_DIR_ENV) or None,
           "checkout": shader_build.in_checkout(), "stale": None}
    if out["checkout"]:
        try:
            out["stale"] = shader_build.stale()
        except Exception as e:  # a source missing: say so, the report goes on
            out["stale_error"] = f"{type(e).__name__}: {e}"
    return out


# --- which kernel each cache attends by ------------------------------------------------------

VARIANT_CACHES = ("f16", "f32", "q8_0", "kivi", "dict", "dict_pre_rope")


def attention_variants(device, n_kv: int = 8, gqa: int = 4, head_dim: int = 64, n_used: int = 32768) -> list[dict]:
    """Per cache type (VARIANT_CACHES; "dict": the forge's default format over random per-head
    dictionaries of 1 024 atoms; "dict_pre_rope": the same with its keys coded before RoPE,
    kvdict_vk.rope — "build" names the K_ROPE build), the SPIR-V variant ``device`` attends one layer of
    ``n_kv`` × ``gqa`` heads at ``head_dim`` over ``n_used`` tokens by — the engine's plan,
    untuned (where the engine tunes, a GPU, it picks a launch shape and, over rows, a build:
    ``tuned_among`` — attend_flash's wide end, and over q8_0 rows its integer dot products where the
    device has them) — with the path, its workgroup size, the optional device features the variant
    needs, and the kernels it runs by only when asked (``on_request``: attend_mma, where the device
    has cooperative matrices)."""
    import numpy as np

    from . import kivi as K
    from . import runtime, synthetic
    from .dictionary import FORGE_RESIDUAL_BITS, FORGE_SPARSITY, KvDictArtifact
    from .rope import KeyRope
    from .vk import KvArena, abi
    from .vk.attend.flash import MMA_KERNEL
    from .vk.attend.ops import flash_shader
    out = []
    for cache in VARIANT_CACHES:
        row = {"cache": cache}
        try:
            if cache.startswith("dict"):
                dicts = synthetic.random_dicts(np.random.default_rng(0), head_dim, 1024, FORGE_SPARSITY,
                                               FORGE_RESIDUAL_BITS, n_kv)
                rope = KeyRope(10000.0, head_dim) if cache == "dict_pre_rope" else None
                with runtime.enabled_with(KvDictArtifact(head_dim, 1024, FORGE_SPARSITY, ((dicts[0], dicts[1]),),
                                                         key_rope=rope), allow_uncertified=True):
                    arena = KvArena(1, n_kv, head_dim, n_used, device=device, cache="dict")
            else:
                arena = KvArena(1, n_kv, head_dim, n_used, device=device, cache=cache,
                                **({"kivi": K.KiviSpec()} if cache == "kivi" else {}))
            with arena:
                att = arena.attention(n_kv * gqa)
                tunes = att.tune  # the engine's own setting here (a CPU driver's plans are untuned)
                att.tune = False
                plan = att.plan(0, n_used)
                variant = att.variant(0, plan)
                v = abi.DECLARATIONS[variant]
                rows_flash = tunes and plan.path == "flash" and not arena.layout.layers[0].k.coded
                tuned = [att.shapes.flash_variant(plan.local, flash_shader(cache == "kivi", k))
                         for k in att.shapes.flash_kernels(0)] if rows_flash else []
                row.update(variant=variant, path=plan.path, local=plan.local or None,
                           **({"build": "K_ROPE"} if cache == "dict_pre_rope" else {}),
                           needs=list(v.subgroup_ops and ("subgroups",)) + list(v.features),
                           tuned_among=tuned if len(tuned) > 1 else [],
                           # kernels this device runs the cache by when asked (Attention.flash_kernel)
                           on_request=([flash_shader(cache == "kivi", MMA_KERNEL)]
                                       if att.shapes.mma_locals(0) else []))
        except Exception as e:  # a cache this device cannot serve says why, the rest go on
            row["error"] = f"{type(e).__name__}: {e}"
        out.append(row)
    return out


def variant_lines(rows: list[dict]) -> list[str]:
    width = max((len(r["cache"]) for r in rows), default=0)
    return [f"{r['cache']:>{width}}: " + (r["error"] if "error" in r else
                                   f"{r['variant']}{' ' + r['build'] + ' build' if r.get('build') else ''} "
                                   f"({r['path']}{', ' + str(r['local']) + ' invocations' if r['local'] else ''}"
                                   f"{', needs ' + ' + '.join(r['needs']) if r['needs'] else ''})"
                                   + (f"; tuned among: {', '.join(r['tuned_among'])}" if r.get("tuned_among") else "")
                                   + (f"; on request: {', '.join(r['on_request'])}" if r.get("on_request") else ""))
            for r in rows]


# --- the report -----------------------------------------------------------------------------

def report() -> dict:
    """{section: dict} for every SECTIONS entry; a section that could not be read holds
    ``{"error": …}`` (devices: ``[{"error": …}]``)."""
    out: dict = {}
    for name, fn in (("host", host), ("devices", devices), ("artifact", artifact),
                     ("tuner_cache", tuner_cache), ("spirv", spirv_manifest)):
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = [_error(e)] if name == "devices" else _error(e)
    try:
        out["versions"] = versions(out["devices"])
    except Exception as e:
        out["versions"] = _error(e)
    return {k: out[k] for k in SECTIONS}


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v) if v else "none"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_value(x)}" for k, x in v.items()) if v else "-"
    return "-" if v is None else str(v)


_FEATURE_LIMITS = ("subgroup_size", "subgroup_operations", "compute_units", "optional_features")  # shown as features


def _kp_line(kp: dict) -> str:
    if kp.get("version") is None and "error" in kp:
        return f"not importable ({kp['error']})"
    patch = {True: "patched", False: "NOT patched (scripts/kp_patch.py)", None: "patch unknown"}[kp.get("patched")]
    line = f"{kp.get('version')}, {patch}"
    if kp.get("patch_hash"):
        current = {True: " (= this checkout's scripts/kp_patch.py)",
                   False: f" (this checkout's is {kp.get('checkout_patch_hash')}: rerun scripts/setup.sh)",
                   None: ""}[kp.get("patch_current")]
        line += f", kp_patch {kp['patch_hash']}{current}"
    return line


def summary_lines(rep: dict | None = None) -> list[str]:
    """A few lines (the test session's header): versions, one per device, artifact, tuner
    cache and SPIR-V in brief."""
    rep = report() if rep is None else rep
    v, lines = rep["versions"], []
    if "error" in v:
        lines.append(f"versions: {v['error']}")
    else:
        lines.append(f"kvdict_vk {v['kvdict_vk']}, numpy {v['numpy']}, kp {_kp_line(v['kp'])}")
    lines += [d["error"] if "error" in d else device_line(d) for d in rep["devices"]] or ["no Vulkan device"]
    a, t, s = rep["artifact"], rep["tuner_cache"], rep["spirv"]
    if "error" not in a:
        lines.append("artifact: " + ("none installed" if a["installed"] is None else
                                     f"{_value(a['installed'])}, " + ("certified" if a["certificate"] else "uncertified")
                                     + (", enabled" if a["enabled"] else ", off")))
    if "error" not in t:
        lines.append(f"tuner cache: {t['path'] or 'none ($' + t['env'] + ' unset)'}"
                     + (f", {t['entries']} entries" if t["exists"] else ""))
    if "error" not in s:
        stale = "" if s["stale"] is None else f", {len(s['stale'])} stale"
        lines.append(f"SPIR-V: {s['variants']} variants, {len(s['missing'])} missing{stale}"
                     + (f", override {s['override_dir']}" if s["override_dir"] else ""))
    return lines


def print_report(file=sys.stdout, rep: dict | None = None) -> None:
    """The whole report, a section at a time, as ``key: value`` lines."""
    rep = report() if rep is None else rep

    def section(title: str, d: dict, indent: str = "    ") -> None:
        print(f"██ {title}", file=file)
        width = max((len(k) for k in d), default=0)
        for k, v in d.items():
            print(f"{indent}{k:>{width}}: {_value(v)}", file=file)

    section("host", rep["host"])
    v = dict(rep["versions"])
    if isinstance(v.get("kp"), dict):
        v["kp"] = _kp_line(v["kp"])
    section("versions", v)
    print("██ devices", file=file)
    for d in rep["devices"] or [{"error": "the Vulkan loader reports no device"}]:
        if "error" in d:
            print(f"    {d['error']}", file=file)
            continue
        print(f"    {device_line(d)}", file=file)
        detail = {"api_version": d.get("api_version"), "vendor/device id": f"{d.get('vendor_id'):#06x}/"
                  f"{d.get('device_id'):#06x}",
                  **{k: x for k, x in d.get("limits", {}).items() if k not in _FEATURE_LIMITS},
                  "heaps": [f"{h['bytes'] / 2**30:.1f} GiB{' device-local' if h['device_local'] else ''}"
                            for h in d.get("heaps", ())],
                  **{f"feature {k}": x for k, x in d.get("features", {}).items()}}
        width = max(len(k) for k in detail)
        for k, x in detail.items():
            print(f"        {k:>{width}}: {_value(x)}", file=file)
    for name, title in (("artifact", "artifact"), ("tuner_cache", "tuner cache"), ("spirv", "SPIR-V")):
        section(title, rep[name])


def main() -> int:
    print_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
