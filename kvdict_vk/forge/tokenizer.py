"""The model's tokenizer, rebuilt from the GGUF metadata with HF ``tokenizers``.

GGUF ``tokenizer.ggml.model == "gpt2"`` with ``pre == "smollm"``: byte-level BPE whose
pre-tokenizer splits every digit on its own before the GPT-2 regex. The GGUF says
``add_bos_token``, but the perplexity numbers in docs/DESIGN.md are measured without a BOS
(the model is an instruct model whose "BOS" is ``<|im_start|>``), so none is added.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's token-type enum (gguf.TokenType): NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4
_CONTROL = 3


def build_tokenizer(reader) -> Tokenizer:
    fields = reader.fields
    model_kind = fields["tokenizer.ggml.model"].contents()
    if model_kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model_kind!r}")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    token_types = fields["tokenizer.ggml.token_type"].contents()
    # Byte-level tokens never contain a raw space (space is 'Ġ'), so one split is exact.
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate token strings in the GGUF vocabulary")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    # Control tokens must match as whole strings and never be split by BPE.
    specials = [tokens[i] for i, t in enumerate(token_types) if t == _CONTROL]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    from .gguf_model import open_reader

    return build_tokenizer(open_reader())


def encode(text: str) -> list[int]:
    return load_tokenizer().encode(text, add_special_tokens=False).ids


def decode(ids) -> str:
    return load_tokenizer().decode([int(i) for i in ids], skip_special_tokens=False)
