"""kvdict-generate: greedy text from SmolLM2-135M with the whole model on the Vulkan device.

    kvdict-generate --prompt "The GNU General Public License is" --tokens 32 --cache f16
    kvdict-generate --cache q8_0 --device NVIDIA
    kvdict-generate --cache dict --artifact out/forge/smollm2.q42art   # the certified dictionaries

Every token — the prompt's, one at a time, then the generated ones — is one submission of a
recorded forward (kvdict_vk.vk.forward.DeviceForward: the GGUF's own Q4_1/Q8_0 weights
resident, the KV cache in the arena). Prints the text, the decode's tokens per second, and the
memory the weights and the arena take. The tokenizer is the forge's (the model's GGUF
metadata, through `tokenizers`). Exit status 1 on bad input, with the error on stderr.
"""
from __future__ import annotations

import argparse
import sys
import time

from .. import errors as E
from .. import layout as L


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="The GNU General Public License is")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    ap.add_argument("--cache", choices=L.CACHES + (L.KIVI_CACHE, "dict"), default="f16",
                    help="the KV cache: f16, f32, q8_0 rows, kivi (KiviSpec()'s: 4 bits, 128 recent tokens) or dict "
                         "(the certified artifact's dictionaries, each token coded on the device)")
    ap.add_argument("--artifact", default="out/forge/smollm2.q42art",
                    help="--cache dict: the certified artifact (make demo forges it there)")
    ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
    a = ap.parse_args(argv)
    from .. import runtime
    from ..forge import tokenizer
    from ..vk import KvArena, get_device
    from ..vk.forward import DeviceForward, from_gguf
    try:
        if a.tokens < 1:
            raise E.ShapeError(f"--tokens must be at least 1, got {a.tokens}")
        prompt = tokenizer.encode(a.prompt)
        if not prompt:
            raise E.ShapeError("the prompt has no tokens")
        weights = from_gguf()
        cfg = weights.config
        dev = get_device(a.device)
        n_ctx = len(prompt) + a.tokens
        if a.cache == "dict":  # the certified artifact for this arena (fail-closed), the switch as it was after
            with runtime.activated(a.artifact):
                arena = KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_ctx, device=dev, cache="dict")
        else:
            arena = KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_ctx, device=dev, cache=a.cache)
    except (E.KvDictError, FileNotFoundError) as e:
        print(f"kvdict-generate: {e}", file=sys.stderr)
        return 1
    try:
        with DeviceForward(weights, arena) as forward:
            t = time.perf_counter()
            for tok in prompt:
                nxt = forward.run(tok)
            prompt_s = time.perf_counter() - t
            out, t = [nxt], time.perf_counter()
            for _ in range(a.tokens - 1):
                out.append(forward.run(out[-1]))
            decode_s = time.perf_counter() - t
            weight_bytes = forward.weight_bytes
        print(a.prompt + tokenizer.decode(out))
        print(f"\n{dev.name}: {len(prompt)} prompt tokens in {prompt_s:.2f} s ({len(prompt) / prompt_s:.1f} tok/s, "
              f"one submission each); {a.tokens - 1} generated after the first in {decode_s:.2f} s "
              f"({(a.tokens - 1) / decode_s:.1f} tok/s)" if a.tokens > 1 else "")
        lay = arena.layout
        print(f"memory: weights {weight_bytes / 2**20:.1f} MiB; {a.cache} KV arena {lay.total_bytes / 2**20:.1f} MiB "
              f"for {arena.memory.seq_ctx} tokens ({lay.bytes_per_token} B a token)")
    finally:
        arena.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
