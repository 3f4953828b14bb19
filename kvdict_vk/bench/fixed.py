"""Fixed costs of the dispatch path: what a submission, a decode step and a read pay
whatever the shaders do. Medians of many, in microseconds (``fixed_costs_us`` of
summary.json: wall time; GPU time beside it where there are timestamps).

* ``submit_roundtrip`` — a recorded 4-byte OpTensorSyncDevice of a one-word "device"
  buffer, Recording.run(): submit, wait, return.
* ``device_submit`` — the same op through Device.submit (record it on the device's reused
  sequence, evaluate once): the path one-off work takes.
* ``empty_submission`` — a recorded compute barrier on a one-word buffer: a submission
  that moves nothing and dispatches nothing (Vulkan has no empty command buffer to
  submit through Kompute).
* ``decode_step_layer`` — one KvArena.step of one layer of the f16 cache (append a token,
  attend over the context), wall time; its GPU time is the attention's (Attention.recording
  at the same length, timestamps: the step adds two one-token scatter dispatches to it).
* ``decode_step_layer_dict`` — the same over a dict-coded cache (the new token's OMP encode
  included, by the encoder KvArena(encoder="auto") chose: ``encoder`` in its entry).
* ``read_back`` — one token read through KvArena.read (f16 cache: dispatch + copy back).

    .venv/bin/python -m kvdict_vk.bench.fixed [--out out/bench_fixed.json]
"""
from __future__ import annotations

import time

import numpy as np

from . import common, timing

NAME, TOOL = "fixed", "kvdict_vk.bench.fixed"
PRESETS = {"quick": ["--repeats", "50", "--steps", "20", "--prefill", "256"],
           "cpu": [],
           "gpu": ["--repeats", "2000", "--steps", "300", "--n-kv", "8", "--gqa", "4", "--head-dim", "128"]}
USES_DEVICE, REQUIRES = True, {}
COSTS = ("submit_roundtrip", "device_submit", "empty_submission", "decode_step_layer", "decode_step_layer_dict",
         "read_back")


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=300)
    ap.add_argument("--gqa", type=int, default=3, help="query heads per KV head (decode step)")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens in the cache before the timed steps")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per cache")
    return common.parse(ap, argv)


def _submissions(dev, repeats: int) -> dict:
    """The submission costs: wall time of recordings without timestamps (writing them is
    not free on every driver), GPU time from timestamped twins run beside them."""
    from kvdict_vk.vk.kernels import Buffer, barrier
    from kvdict_vk.vk.submit import Recording
    from kvdict_vk.vk.device import kp
    word = Buffer(dev, 1, "device", "one word")
    scratch = Buffer(dev, 1, "storage", "one word, no host copy")
    sync, nothing = kp.OpTensorSyncDevice([word.tensor]), barrier(scratch)
    recs = {}
    try:
        for stamped in (False, True):
            tail = "_timestamped" if stamped else ""
            recs[f"submit_roundtrip{tail}"] = Recording(dev, [sync], timestamps=stamped, what="4-byte sync")
            recs[f"empty_submission{tail}"] = Recording(dev, [nothing], timestamps=stamped, what="empty submission")
        for rec in recs.values():
            rec.run()
        dev.submit(sync, what="4-byte sync")
        times = timing.measure({**recs, "device_submit": lambda: dev.submit(sync, what="4-byte sync")}, repeats)
    finally:
        for rec in recs.values():
            rec.free()
        word.destroy()
        scratch.destroy()
    for name in ("submit_roundtrip", "empty_submission"):
        stamped = times.pop(f"{name}_timestamped")
        times[name].update(gpu_s=stamped["gpu_s"], gpu=stamped["gpu"], wall_with_timestamps_s=stamped["wall_s"])
        times[name].pop("note", None)
        if stamped["gpu_s"] is None:
            times[name]["note"] = timing.NO_TIMESTAMPS
    return times


def _dict_artifact(args, rng):
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    hd, na = args.head_dim, args.n_atoms
    atoms = rng.standard_normal((na, hd))
    atoms = (atoms / np.linalg.norm(atoms, axis=1, keepdims=True)).astype(np.float32)
    d = StreamDict(atoms, mean=np.zeros(hd, np.float32), sparsity=args.sparsity)
    return KvDictArtifact(hd, na, args.sparsity, ((d, d),))


def _decode_steps(dev, args, rng, cache: str) -> dict:
    """Wall time of KvArena.step over ``args.steps`` tokens after a prefill, and the GPU
    time of the attention at the final length."""
    from kvdict_vk import runtime
    from kvdict_vk.vk import KvArena
    n_kv, hd = args.n_kv, args.head_dim
    n_ctx = args.prefill + args.steps + 1
    if cache == "dict":
        with runtime.enabled_with(_dict_artifact(args, rng), allow_uncertified=True):
            arena = KvArena(1, n_kv, hd, n_ctx, device=dev, cache="dict")
    else:
        arena = KvArena(1, n_kv, hd, n_ctx, device=dev, cache=cache)
    try:
        prefill = [rng.standard_normal((n_kv, args.prefill, hd), dtype=np.float32) for _ in "kv"]
        arena.append(0, *prefill)
        new = rng.standard_normal((args.steps + 1, 2, n_kv, 1, hd), dtype=np.float32)
        q = rng.standard_normal((n_kv * args.gqa, hd), dtype=np.float32)
        arena.step(0, new[0, 0], new[0, 1], q)  # warm-up: pipelines, buffers
        wall = []
        for i in range(1, args.steps + 1):
            t = time.perf_counter()
            arena.step(0, new[i, 0], new[i, 1], q)
            wall.append(time.perf_counter() - t)
        n = arena.n_tokens(0)
        with arena.attention(q.shape[0]).recording(0, q, n, timestamps=True) as rec:
            gpu = []
            for _ in range(min(args.steps, 50)):
                rec.run()
                gpu.append(rec.gpu_seconds())
        out = timing.timing(wall, gpu)
        out.update(cache=cache, n_used=n, n_kv=n_kv, gqa=args.gqa, head_dim=hd)
        if cache == "dict":  # which encoder KvArena(encoder="auto") wrote the new tokens with
            from kvdict_vk.vk.encode import choice as encode_choice
            out["encoder"] = "/".join(sorted(set(encode_choice.measured().values())))
        return out, arena
    except BaseException:
        arena.free()
        raise


def _read_back(arena, repeats: int) -> dict:
    n = arena.n_tokens(0)
    arena.read(0, 0, 1)  # warm-up: the pipeline and the read-back buffer
    wall = []
    for i in range(repeats):
        t0 = i % n
        t = time.perf_counter()
        arena.read(0, t0, t0 + 1)
        wall.append(time.perf_counter() - t)
    return timing.timing(wall, recorded=False)


def run(args, progress) -> dict:
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    t0 = time.time()
    progress(f"{dev.name}: submissions × {args.repeats}")
    costs = _submissions(dev, args.repeats)
    progress(f"decode steps: f16 cache, {args.n_kv}x{args.gqa} d{args.head_dim}, {args.prefill} + {args.steps} tokens")
    costs["decode_step_layer"], f16 = _decode_steps(dev, args, rng, "f16")
    try:
        progress(f"read back × {args.repeats}")
        costs["read_back"] = _read_back(f16, args.repeats)
    finally:
        f16.free()
    progress("decode steps: dict cache")
    costs["decode_step_layer_dict"], coded = _decode_steps(dev, args, rng, "dict")
    coded.free()
    for name in ("decode_step_layer", "decode_step_layer_dict"):
        costs[name]["gpu_what"] = "the attention part (Attention.recording at the final length)"
    costs["decode_step_layer_dict"]["wall_what"] = "KvArena.step, the new token's OMP encode included (by 'encoder')"
    result = {**common.run_header(TOOL, args, dev, t0),
              "config": {k: getattr(args, k) for k in ("n_kv", "gqa", "head_dim", "prefill", "steps", "repeats",
                                                       "n_atoms", "sparsity")},
              "costs": {name: costs[name] for name in COSTS}}
    return result


def fixed_costs_us(result) -> dict:
    """{cost: wall-time median in µs} — summary.json's ``fixed_costs_us``."""
    return {name: 1e6 * c["wall_s"] for name, c in result["costs"].items()}


def fixed_costs_gpu_us(result) -> dict:
    """{cost: GPU-time median in µs, or None}."""
    return {name: None if c["gpu_s"] is None else 1e6 * c["gpu_s"] for name, c in result["costs"].items()}


def rows(result) -> list[dict]:
    return []  # summary.json carries these as fixed_costs_us, not as rows


ROUNDTRIP_GOAL_S = 30e-6  # issue 11, on the H200: below CUDA's tiny kernel + synchronize (31.5 µs)


def headline(result) -> list[dict]:
    """The submission round trip over issue 11's goal for a GPU (≤ 30 µs)."""
    rt = result["costs"]["submit_roundtrip"]["wall_s"]
    return [{"figure": "submit round trip / 30 µs goal", "case": "4-byte sync, recorded",
             "numerator": rt, "denominator": ROUNDTRIP_GOAL_S, "unit": "s", "ratio": rt / ROUNDTRIP_GOAL_S}]


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: fixed costs (median µs, wall / GPU)"]
    for name, c in result["costs"].items():
        gpu = "—" if c["gpu_s"] is None else f"{1e6 * c['gpu_s']:.1f}"
        lines.append(f"  {name:24s} {1e6 * c['wall_s']:10.1f}  {gpu:>10}")
    return lines


def plot(plt, result):
    names = list(result["costs"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.barh(names, [1e6 * result["costs"][n]["wall_s"] for n in names], color="#37c", label="wall")
    gpu = [result["costs"][n]["gpu_s"] for n in names]
    ax.barh(names, [0 if g is None else 1e6 * g for g in gpu], color="#c73", height=0.4, label="GPU")
    ax.set_xscale("log")
    ax.set_xlabel("µs (median)")
    ax.set_title(f"{result['device']['name']}: fixed costs", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
