"""A llama model's weights as the device forward holds them (shaders/weights.glsl's formats).

Matrices keep GGUF's own blocks — Q4_1 as stored (5 words a block of 32), Q8_0 padded by
two bytes to 9 words — so the device reads exactly the numbers the GGUF holds, dequantising
on the fly; float32 and float16 tensors become float32 words. :func:`dequantised` is the
NumPy twin (gguf-py's arithmetic; kvdict_vk.forge.gguf_model.dequantised_model the whole
model's), :func:`from_gguf` reads a file and :func:`to_gguf` writes one (the forge's gguf
extra), :func:`random_weights` makes a model of given shapes (speed runs where no GGUF is at
hand).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import errors as E
from ...model_file import ModelConfig

FORMATS = {"f32": 0, "q4_1": 1, "q8_0": 2}  # weights.glsl's W_* (FORMAT)
BLOCK = 32  # columns a block holds
BLOCK_WORDS = {"f32": 32, "q4_1": 5, "q8_0": 9}
# a layer's tensors: LayerWeights' field → the GGUF's name (blk.<i>.<name>.weight)
GGUF_LAYER = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
              "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


@dataclass(frozen=True, eq=False)
class Matrix:
    """(n_rows, n_cols) weights in a weights.glsl format: ``words`` (n_rows, row_words)."""
    fmt: str
    n_rows: int
    n_cols: int
    words: np.ndarray

    def __post_init__(self):
        if self.fmt not in FORMATS or self.n_cols % BLOCK or self.n_rows < 1:
            raise E.ShapeError(f"a {self.fmt} matrix of {self.n_rows} × {self.n_cols}: formats {tuple(FORMATS)}, "
                               f"columns a multiple of {BLOCK}")
        if self.words.dtype != np.uint32 or self.words.shape != (self.n_rows, self.row_words):
            raise E.ShapeError(f"{self.fmt} matrix {self.n_rows} × {self.n_cols}: words must be uint32 "
                               f"{(self.n_rows, self.row_words)}, got {self.words.dtype} {self.words.shape}")

    @property
    def row_words(self) -> int:
        return self.n_cols // BLOCK * BLOCK_WORDS[self.fmt]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_norm: np.ndarray  # (hidden,) float32
    wq: Matrix  # (n_heads · head_dim, hidden), GGUF's adjacent-pair RoPE row order
    wk: Matrix
    wv: Matrix
    wo: Matrix
    ffn_norm: np.ndarray
    w_gate: Matrix
    w_up: Matrix
    w_down: Matrix


@dataclass(frozen=True, eq=False)
class ModelWeights:
    config: ModelConfig
    tok_embd: Matrix  # (vocab, hidden)
    output_norm: np.ndarray
    output: Matrix  # the same Matrix as tok_embd when tied
    layers: tuple


def f32_matrix(a: np.ndarray) -> Matrix:
    a = np.ascontiguousarray(a, np.float32)
    return Matrix("f32", a.shape[0], a.shape[1], a.view(np.uint32))


def q4_1_matrix(raw: np.ndarray, n_rows: int, n_cols: int) -> Matrix:
    """GGUF Q4_1 bytes (n_rows · n_cols / 32 blocks of 20) as stored."""
    b = np.ascontiguousarray(raw, np.uint8).reshape(n_rows, n_cols // BLOCK * 20)
    return Matrix("q4_1", n_rows, n_cols, b.view(np.uint32))


def q8_0_matrix(raw: np.ndarray, n_rows: int, n_cols: int) -> Matrix:
    """GGUF Q8_0 bytes (blocks of 34: d, 32 int8), each block padded after d to 36."""
    b = np.ascontiguousarray(raw, np.uint8).reshape(n_rows, n_cols // BLOCK, 34)
    padded = np.zeros((n_rows, n_cols // BLOCK, 36), np.uint8)
    padded[..., :2], padded[..., 4:] = b[..., :2], b[..., 2:]
    return Matrix("q8_0", n_rows, n_cols, padded.reshape(n_rows, -1).view(np.uint32))


def dequantised(m: Matrix) -> np.ndarray:
    """The float32 (n_rows, n_cols) a Matrix holds (gguf-py's dequantisation: d · q + m, q · d)."""
    if m.fmt == "f32":
        return m.words.view(np.float32).copy()
    blocks = m.words.reshape(m.n_rows, m.n_cols // BLOCK, BLOCK_WORDS[m.fmt])
    d = blocks[..., 0].astype(np.uint16).view(np.float16).astype(np.float32)[..., None]
    if m.fmt == "q4_1":
        mins = (blocks[..., 0] >> 16).astype(np.uint16).view(np.float16).astype(np.float32)[..., None]
        qs = blocks[..., 1:].copy().view(np.uint8)  # (rows, blocks, 16)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        return (d * q + mins).reshape(m.n_rows, m.n_cols)
    q = blocks[..., 1:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(m.n_rows, m.n_cols)


def from_gguf(path=None) -> ModelWeights:
    """A llama GGUF's weights (F32 / F16 / Q4_1 / Q8_0 tensors) and hyper-parameters."""
    from ...model_file import open_reader, read_config
    reader = open_reader(path)
    cfg = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def matrix(name: str) -> Matrix:
        t = tensors[name]
        n_cols, n_rows = (int(x) for x in t.shape[:2])
        kind = t.tensor_type.name
        if kind == "Q4_1":
            return q4_1_matrix(t.data, n_rows, n_cols)
        if kind == "Q8_0":
            return q8_0_matrix(t.data, n_rows, n_cols)
        if kind in ("F32", "F16"):
            return f32_matrix(np.asarray(t.data, np.float32).reshape(n_rows, n_cols))
        raise E.ShapeError(f"{name}: GGUF type {kind} has no device format (have F32, F16, Q4_1, Q8_0)")

    def vector(name: str) -> np.ndarray:
        return np.ascontiguousarray(tensors[name].data, np.float32).reshape(-1)

    layers = tuple(LayerWeights(**{f: (vector if f.endswith("norm") else matrix)(f"blk.{i}.{g}.weight")
                                   for f, g in GGUF_LAYER.items()}) for i in range(cfg.n_layers))
    tok = matrix("token_embd.weight")
    return ModelWeights(cfg, tok, vector("output_norm.weight"),
                        tok if cfg.tied_output else matrix("output.weight"), layers)


def random_weights(cfg: ModelConfig, rng: np.random.Generator, fmt: str = "q4_1",
                   embedding: str | None = None) -> ModelWeights:
    """Weights of ``cfg``'s shapes, random (Q4_1 or Q8_0 blocks, or float32; the embedding and
    LM head in ``embedding``'s format, default ``fmt``), scaled so activations stay of order
    one: a model for timing, not for text."""
    def matrix(n_rows: int, n_cols: int, fmt: str = fmt) -> Matrix:
        scale = np.float32(1.0 / np.sqrt(n_cols))
        if fmt == "f32":
            return f32_matrix(rng.standard_normal((n_rows, n_cols), dtype=np.float32) * scale)
        n_blocks = n_rows * n_cols // BLOCK
        words = rng.integers(0, 2**32, (n_blocks, BLOCK_WORDS[fmt]), dtype=np.uint64).astype(np.uint32)
        d = np.float16(scale / (4 if fmt == "q4_1" else 64))  # q4_1: d · q + m, m = -8 d: d · (q - 8)
        words[:, 0] = int(d.view(np.uint16)) | (int(np.float16(-8 * d).view(np.uint16)) << 16 if fmt == "q4_1" else 0)
        return Matrix(fmt, n_rows, n_cols, words.reshape(n_rows, -1))

    h, q, kv = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    ones = np.ones(h, np.float32)
    layers = tuple(LayerWeights(ones, matrix(q, h), matrix(kv, h), matrix(kv, h), matrix(h, q), ones,
                                matrix(cfg.ffn, h), matrix(cfg.ffn, h), matrix(h, cfg.ffn))
                   for _ in range(cfg.n_layers))
    emb = embedding or fmt
    tok = matrix(cfg.vocab, h, emb)
    return ModelWeights(cfg, tok, ones, tok if cfg.tied_output else matrix(cfg.vocab, h, emb), layers)


def _gguf_bytes(m: Matrix) -> tuple:
    """A Matrix as a GGUF tensor: (data — float32, or the blocks' bytes a row —, GGML type name)."""
    if m.fmt == "f32":
        return m.words.view(np.float32), None
    raw = m.words.view(np.uint8).reshape(m.n_rows, m.n_cols // BLOCK, 4 * BLOCK_WORDS[m.fmt])
    if m.fmt == "q8_0":  # drop the two bytes of padding after d
        raw = np.concatenate([raw[..., :2], raw[..., 4:]], axis=-1)
    return np.ascontiguousarray(raw.reshape(m.n_rows, -1)), m.fmt.upper()


def to_gguf(w: ModelWeights, path) -> None:
    """Write ``w`` as a llama GGUF (the forge's extra gguf), with a placeholder vocabulary (a
    SentencePiece-style list: <unk>, <s>, </s>, the 256 byte tokens, then t<i>): what a random
    model needs for llama.cpp to load it beside ours (kvdict_vk.bench.generate)."""
    import gguf
    cfg = w.config
    out = gguf.GGUFWriter(str(path), cfg.arch)
    out.add_context_length(cfg.context_length)
    out.add_embedding_length(cfg.hidden)
    out.add_block_count(cfg.n_layers)
    out.add_feed_forward_length(cfg.ffn)
    out.add_rope_dimension_count(cfg.rope_dim)
    out.add_head_count(cfg.n_heads)
    out.add_head_count_kv(cfg.n_kv_heads)
    out.add_layer_norm_rms_eps(cfg.rms_eps)
    out.add_rope_freq_base(cfg.rope_theta)
    out.add_vocab_size(cfg.vocab)
    if cfg.head_dim * cfg.n_heads != cfg.hidden:
        out.add_key_length(cfg.head_dim)
        out.add_value_length(cfg.head_dim)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(cfg.vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (cfg.vocab - 259)  # unknown, control, byte, normal
    out.add_tokenizer_model("llama")
    out.add_token_list(tokens[:cfg.vocab])
    out.add_token_scores([0.0] * cfg.vocab)
    out.add_token_types(types[:cfg.vocab])

    def add(name: str, m) -> None:
        if isinstance(m, np.ndarray):
            out.add_tensor(name, np.ascontiguousarray(m, np.float32))
            return
        data, kind = _gguf_bytes(m)
        out.add_tensor(name, data, raw_dtype=kind and gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", w.tok_embd)
    add("output_norm.weight", w.output_norm)
    if w.output is not w.tok_embd:
        add("output.weight", w.output)
    for i, layer in enumerate(w.layers):
        for field, name in GGUF_LAYER.items():
            add(f"blk.{i}.{name}.weight", getattr(layer, field))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
