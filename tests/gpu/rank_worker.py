"""One torch.distributed rank of tests/gpu/test_vk_ranks.py: joins a gloo group through a file,
runs ``script`` over a RankArena for every case it is given, and saves what each call handed
back. ``script`` is also what the test runs over one device's KvArena, so both sides make the
same calls with the same numbers.

    python rank_worker.py RANK WORLD INIT_FILE CASES_PICKLE OUT_PICKLE
"""
from __future__ import annotations

import pickle
import sys

import numpy as np

N_LAYERS, N_KV, HD, N_CTX, GROUP = 3, 3, 64, 96, 2


def script(arena, seed: int, coded_by=None) -> list:
    """Appends (rows, or with ``coded_by`` — each layer's (K, V) StreamDicts — their slots),
    reads, attention, a step and a recorded step over two layers, and two refusals; what each
    call handed back (a refusal: its error's class name), in order."""
    from kvdict_vk import codec
    from kvdict_vk import errors as E
    rng = np.random.default_rng(seed)
    out = []
    for layer in range(N_LAYERS):
        for n in (1, 50, 2):
            k, v = (rng.standard_normal((N_KV, n, HD)).astype(np.float32) for _ in "kv")
            if coded_by is None:
                out.append(arena.append(layer, k, v))
            else:
                out.append(arena.append_codes(layer, *(codec.encode_heads(x, d) for x, d in zip((k, v), coded_by[layer]))))
        out.append(arena.n_tokens(layer))
        out += list(arena.read(layer))
        q = rng.standard_normal((N_KV * GROUP, HD)).astype(np.float32)
        n = arena.n_tokens(layer)
        out += [arena.attend(layer, q, used) for used in (1, n // 2, n)]
        if coded_by is None:
            k, v = (rng.standard_normal((N_KV, 1, HD)).astype(np.float32) for _ in "kv")
            out.append(arena.step(layer, k, v, q))
    layers = [0, 2]
    step = arena.record_step(N_KV * GROUP, layers)
    for _ in range(2):
        k, v = (rng.standard_normal((len(layers), 1, N_KV, HD)).astype(np.float32) for _ in "kv")
        q = rng.standard_normal((len(layers), 1, N_KV * GROUP, HD)).astype(np.float32)
        out.append(step.run(k, v, q))
    out += [arena.n_tokens(i) for i in range(N_LAYERS)]
    for bad in (lambda: arena.append(1, *(np.zeros((N_KV, 1, HD + 1), np.float32),) * 2),
                lambda: arena.attend(2, np.zeros((N_KV + 1, HD), np.float32), 1),
                lambda: arena.append(0, *(np.zeros((N_KV, N_CTX, HD), np.float32),) * 2)):
        try:
            bad()
            out.append("accepted")
        except E.KvDictError as exc:
            out.append(type(exc).__name__)
    out += [arena.n_tokens(i) for i in range(N_LAYERS)]
    return out


def model(seed: int):
    """A random model of N_LAYERS layers over N_KV KV heads × HD (hidden 96, q8_0 weights)."""
    from kvdict_vk.model_file import ModelConfig
    from kvdict_vk.vk.forward import random_weights
    cfg = ModelConfig("llama", N_LAYERS, 96, N_KV * GROUP, N_KV, HD, 160, 10000.0, HD, 1e-5, 300, 64, True)
    return random_weights(cfg, np.random.default_rng(seed), "q8_0")


def decode(forward, seed: int, n: int = 8) -> list:
    """The greedy tokens ``forward`` hands back for ``n`` random tokens fed, and (where it has
    them) each token's logits."""
    tokens = np.random.default_rng(seed).integers(0, forward.config.vocab, n)
    out = []
    for tok in tokens:
        out.append(forward.run(int(tok)))
        try:
            out.append(forward.logits())
        except Exception:  # noqa: BLE001 — a rank without the last layers has none
            out.append(None)
    return out


def main(argv) -> int:
    rank, world, init_file, cases_path, out_path = int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5]
    import torch.distributed as dist
    from kvdict_vk import runtime
    from kvdict_vk.vk.ranks import RankArena
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with open(cases_path, "rb") as f:
        cases = pickle.load(f)
    results = {}
    for name, case in cases.items():
        kw = dict(cache=case["cache"], guard_words=16, **case.get("arena_kw", {}))
        if case["artifact"] is not None:
            runtime.enable(case["artifact"], allow_uncertified=True)
            kw = dict(encoder="cpu", guard_words=16)
        with RankArena(N_LAYERS, N_KV, HD, N_CTX, case["device"], split=case["split"], **kw) as arena:
            if case.get("forward"):  # the model's decode over the layer split (SplitForward)
                from kvdict_vk.vk.forward import SplitForward
                with SplitForward(model(case["seed"]), arena, logits=True, row_threads=8) as fw:
                    calls = decode(fw, case["seed"])
                    calls.append(fw.weight_bytes)
            else:
                coded = None if case["artifact"] is None else case["artifact"].layers
                calls = script(arena, case["seed"], coded)
            part = arena.part
            results[name] = dict(calls=calls, memory=arena.memory(), layers=part.layers, heads=part.heads,
                                 guard_breaches=part.arena.layout.guard_breaches(part.arena.layer_words),
                                 exchange_s=arena.exchange_s)
        runtime.disable()
    # a part one rank cannot make (here: rank 1's too large for any device) is every rank's refusal
    try:
        RankArena(N_LAYERS, N_KV, HD, N_CTX if rank == 0 else 1 << 40, cases[next(iter(cases))]["device"],
                  split="layer", cache="f16")
        results["refused"] = "accepted"
    except Exception as exc:  # noqa: BLE001 — the test checks its class
        results["refused"] = type(exc).__name__
    with open(out_path, "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
