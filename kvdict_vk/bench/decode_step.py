"""A model's decode step recorded once (KvArena.record_step) against KvArena.step per layer: host and GPU time per token.

Per case (a model shape — layers × KV heads × query heads per KV head × head_dim —, a cache,
a context length) one arena is filled to that length and three candidates run interleaved,
token after token, each appending its token to every layer:

* ``recorded``: KvArena.record_step's DecodeStep (every layer, one submission, launch shape
  planned at the arena's capacity), wall time by time.perf_counter around ``run`` and GPU
  time from its timestamps — ``gpu_s`` the appends and attentions, ``submitted_gpu_s`` all it
  submitted (with the copies of the queries up and the output back); host time = wall −
  submitted GPU time, the issue's measure;
* ``recorded_at_length``: the same, its launch shape planned at the case's length (what the
  capacity plan costs on the GPU, if anything);
* ``recorded_in_place``: a step planned as ``recorded`` whose token is written into its own
  buffers (DecodeStep.inputs, outside the timed span) and replayed (DecodeStep.replay, timed):
  what an engine whose queries and rows are made in those buffers pays;
* ``per_layer_step``: KvArena.step on every layer in turn (Python builds each layer's
  operations and submits them: the path before recording), wall time.

Beside them ``engine_attention_gpu_s``: the GPU time of the engine's own attention of each
layer (Attention.recording at that length, its tuned plan), summed over the layers — what
the recorded step's GPU time should not exceed by more than its appends.

    python -m kvdict_vk.bench.decode_step [--shapes 30x3x3x64] [--contexts 1024,32768]
        [--caches f16,q8_0] [--tokens 40] [--out out/bench_decode_step.json]

Writes the JSON and a PNG (same stem) next to it.
"""
from __future__ import annotations

import time

import numpy as np

from . import common

NAME, TOOL = "decode_step", "kvdict_vk.bench.decode_step"
HOST_BUDGET_US = (50.0, 2.0)  # issue 52: host time per token ≤ 50 µs + 2 µs per layer
WARM_TOKENS, WARM_S = 256, 0.5  # untimed steps after the fill (kvdict_vk.bench.generate says why)


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=1)
    ap.add_argument("--shapes", default="30x3x3x64",
                    help="layers x KV heads x query heads per KV head x head_dim, comma-separated "
                         "(default: SmolLM2-135M's)")
    ap.add_argument("--contexts", default="1024", help="tokens in the cache before the timed steps")
    ap.add_argument("--caches", default="f16,q8_0")
    ap.add_argument("--tokens", type=int, default=20, help="timed steps per candidate")
    return common.parse(ap, argv)


def fill_random(arena, rng, n_tokens: int, seqs: int = 1) -> None:
    """n_tokens random rows in every layer of sequences 0 .. seqs − 1 (the same rows: the times do
    not depend on them); a dict-coded stream random slots of its dictionary (coding that many
    rows would take longer than the run), beside the rows where the layer keeps an exact window."""
    from kvdict_vk import synthetic
    lay = arena.layout
    chunk = 4096
    k = rng.standard_normal((lay.n_kv_heads, min(chunk, n_tokens), lay.head_dim), dtype=np.float32)
    for layer in range(lay.n_layers):
        streams = lay.layers[layer].streams
        src = [synthetic.random_slots(rng, arena.stream_dict(layer, st.stream), k.shape[:2]) if st.coded else k
               for st in streams]
        for t0 in range(0, n_tokens, chunk):
            n = min(chunk, n_tokens - t0)
            for seq in range(seqs):
                if any(st.coded for st in streams):  # a windowed layer keeps the rows of its window too
                    rows = (k[:, :n], k[:, :n]) if lay.layers[layer].windowed else None
                    arena.append_codes(layer, *(s[:, :n] for s in src), rows=rows, seq=seq)
                else:
                    arena.append(layer, k[:, :n], k[:, :n], seq=seq)


def bench_case(dev, shape, cache: str, n_ctx: int, args, rng, progress) -> dict:
    from kvdict_vk.vk import KvArena
    n_layers, n_kv, group, hd = shape
    n_heads = n_kv * group
    capacity = n_ctx + 4 * (args.tokens + 2) + WARM_TOKENS
    arena = KvArena(n_layers, n_kv, hd, capacity, device=dev, cache=cache)
    try:
        fill_random(arena, rng, n_ctx)
        t = time.perf_counter()
        steps = {"recorded": arena.record_step(n_heads, timestamps=True),
                 "recorded_at_length": arena.record_step(n_heads, n_plan=n_ctx, timestamps=True),
                 "recorded_in_place": arena.record_step(n_heads, timestamps=True)}
        setup = time.perf_counter() - t
        att = arena.attention(n_heads)
        q1 = rng.standard_normal((n_heads, hd), dtype=np.float32)
        engine_gpu = 0.0
        for layer in range(n_layers):
            rec = att.recording(layer, q1, n_ctx, timestamps=True)
            try:
                best = []
                for _ in range(3):
                    rec.run()
                    best.append(rec.core_seconds() or 0.0)
                engine_gpu += min(best)
            finally:
                rec.free()
        k, v, q = (rng.standard_normal((n_layers, 1, h, hd), dtype=np.float32) for h in (n_kv, n_kv, n_heads))
        k_rows, v_rows = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()

        def per_layer():
            for layer in range(n_layers):
                arena.step(layer, k_rows[layer], v_rows[layer], q[layer, 0])
        for step in steps.values():  # first runs: pipelines warm, clocks up
            step.run(k, v, q)
        for view, values in zip(steps["recorded_in_place"].inputs(), (k, v, q)):
            view[:] = values
        t0, warm = time.perf_counter(), 0
        while warm < WARM_TOKENS and time.perf_counter() - t0 < WARM_S:  # the GPU's clocks up after the fill
            steps["recorded"].run(k, v, q)
            warm += 1
        per_layer()
        wall = {name: [] for name in (*steps, "per_layer_step")}
        gpu = {name: [] for name in steps}
        submitted = {name: [] for name in steps}
        for i in range(args.tokens):
            for name, step in steps.items():
                t = time.perf_counter()
                if name == "recorded_in_place":
                    step.replay()
                else:
                    step.run(k, v, q)
                wall[name].append(time.perf_counter() - t)
                gpu[name].append(step.gpu_seconds())
                submitted[name].append(step.submitted_gpu_seconds())
            t = time.perf_counter()
            per_layer()
            wall["per_layer_step"].append(time.perf_counter() - t)
            progress(f"{n_layers}x{n_kv}x{group}x{hd} {cache} {n_ctx}: token {i + 1}/{args.tokens}")
        out = {"shape": list(shape), "cache": cache, "n_ctx": n_ctx, "layers": n_layers, "batch": 1,
               "setup_s": setup, "engine_attention_gpu_s": engine_gpu,
               "host_budget_us": HOST_BUDGET_US[0] + HOST_BUDGET_US[1] * n_layers}
        for name in wall:
            entry = {"wall_s": common.stats(wall[name])}
            if name in gpu and None not in gpu[name] and None not in submitted[name]:
                entry["gpu_s"] = common.stats(gpu[name])
                entry["submitted_gpu_s"] = common.stats(submitted[name])
                entry["host_s"] = common.stats(np.subtract(wall[name], submitted[name]))
            out[name] = entry
        rec = out["recorded"]
        if "host_s" in rec:
            out["meets_host_budget"] = 1e6 * rec["host_s"]["median"] <= out["host_budget_us"]
            out["in_place_meets_host_budget"] = 1e6 * out["recorded_in_place"]["host_s"]["median"] <= out["host_budget_us"]
            out["gpu_over_engine_attention"] = rec["gpu_s"]["median"] / engine_gpu if engine_gpu else None
        out["per_layer_over_recorded_wall"] = out["per_layer_step"]["wall_s"]["median"] / rec["wall_s"]["median"]
        return out
    finally:
        arena.free()


def run(args, progress) -> dict:
    dev = common.open_device(args)
    rng = np.random.default_rng(0)
    t0 = time.time()
    cases = []
    for shape in (common.dims(s) for s in args.shapes.split(",") if s.strip()):
        if len(shape) != 4:
            raise SystemExit(f"--shapes: {shape} is not layers x KV heads x group x head_dim")
        for cache in (c for c in args.caches.split(",") if c.strip()):
            for n_ctx in (int(c) for c in args.contexts.split(",") if c.strip()):
                cases.append(bench_case(dev, shape, cache, n_ctx, args, rng, progress))
    return {**common.run_header(TOOL, args, dev, t0),
            "config": {"shapes": args.shapes, "contexts": args.contexts, "caches": args.caches,
                       "tokens": args.tokens}, "cases": cases}


def report(result) -> list[str]:
    lines = [f"{result['device']['name']}: µs per token (median); host = wall − GPU"]
    for c in result["cases"]:
        r, a, p = c["recorded"], c["recorded_at_length"], c["per_layer_step"]
        us = lambda e, k: f"{1e6 * e[k]['median']:9.1f}" if k in e else "        —"  # noqa: E731
        lines.append(f"  {'x'.join(map(str, c['shape']))} {c['cache']:5s} {c['n_ctx']:7d}: recorded wall {us(r, 'wall_s')} "
                     f"GPU {us(r, 'gpu_s')} (submitted {us(r, 'submitted_gpu_s')}) host {us(r, 'host_s')} "
                     f"(budget {c['host_budget_us']:.0f}; in place {us(c['recorded_in_place'], 'host_s')}); "
                     f"at length GPU {us(a, 'gpu_s')}; engine attention GPU {1e6 * c['engine_attention_gpu_s']:9.1f}; "
                     f"per-layer step wall {us(p, 'wall_s')}")
    return lines


def plot(plt, result):
    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases)), 4))
    x = np.arange(len(cases))
    for i, (name, key) in enumerate((("recorded host", ("recorded", "host_s")), ("recorded GPU", ("recorded", "gpu_s")),
                                     ("per-layer step wall", ("per_layer_step", "wall_s")))):
        vals = [1e6 * c[key[0]][key[1]]["median"] if key[1] in c[key[0]] else 0 for c in cases]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=name)
    ax.set_xticks(x, [f"{'x'.join(map(str, c['shape']))}\n{c['cache']} {c['n_ctx']}" for c in cases], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs per token")
    ax.set_title(f"decode step, {result['device']['name']}")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
