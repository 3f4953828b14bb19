"""Real-model forge: GGUF loading, tokenizer, NumPy llama forward, KV hooks, baseline quantisers."""

import numpy as np
import pytest

# The forge extra (gguf, tokenizers) and the model are part of the test environment:
# without them these tests fail at import, they do not skip.
from kvdict_vk.forge import llama, quant
from kvdict_vk.forge.gguf_model import load_model
from kvdict_vk.forge.texts import EVAL_TEXTS
from kvdict_vk.forge.tokenizer import decode, encode


def _gpl3() -> str:
    return EVAL_TEXTS["gpl3"].text()


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def gpl3_tokens():
    return np.asarray(encode(_gpl3()), dtype=np.int64)


@pytest.fixture(scope="module")
def short_window(gpl3_tokens):
    return gpl3_tokens[:192]  # hook tests: short, so each forward is well under a second


@pytest.fixture(scope="module")
def short_logits(model, short_window):
    return llama.forward(short_window)


# ---------------------------------------------------------------- model and tokenizer

def test_config_read_from_metadata(model):
    c = model.config
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn) == (30, 576, 9, 3, 64, 1536)
    assert (c.rope_theta, c.rope_dim, c.vocab, c.tied_output) == (100000.0, 64, 49152, True)
    assert c.rms_eps == pytest.approx(1e-5)
    assert model.output is model.tok_embd
    assert model.layers[0].wk.shape == (192, 576) and model.layers[0].wk.dtype == np.float32
    assert len(model.sha256) == 64 and model.path.suffix == ".gguf"
    assert load_model() is model  # cached in-process


def test_tokenizer_round_trips_gpl3(gpl3_tokens):
    text = _gpl3()
    assert len(text) == 35149
    assert len(gpl3_tokens) == 7639
    assert decode(gpl3_tokens) == text


def test_tokenizer_digits_and_control_tokens():
    ids = encode("ab 2024<|im_start|>")
    assert [decode([i]) for i in ids[-5:]] == ["2", "0", "2", "4", "<|im_start|>"]
    assert ids[-1] == 1  # a control token is one token, not BPE pieces


def test_perplexity_first_window(gpl3_tokens):
    windows = llama.eval_windows(gpl3_tokens, 1024)
    assert [len(w) for w in windows] == [1024] * 7  # the 471-token tail is not a window
    assert len(llama.eval_windows(gpl3_tokens, 1024, keep_tail=True)[-1]) == 7639 - 7 * 1024
    ppl = llama.perplexity(windows[:1])
    assert ppl == pytest.approx(19.28, rel=0.01)


def test_token_nll_matches_forward_logits(short_window, short_logits):
    nll = llama.token_nll(short_window)
    logits = short_logits[:-1].astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    expected = lse - logits[np.arange(len(logits)), short_window[1:]]
    assert nll.dtype == np.float64 and nll.shape == (len(short_window) - 1,)
    np.testing.assert_allclose(nll, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- hooks and RoPE

class _Unchanged(llama.KVHook):
    def __call__(self, layer, k, v):
        return k.copy(), v.copy()


class _RopeRoundTrip(llama.KVHook):
    """Un-rotate then re-rotate keys before RoPE: the path a pre-RoPE key coder takes."""

    def keys_pre_rope(self, layer, k):
        pos, theta = np.arange(k.shape[1]), load_model().config.rope_theta
        return llama.unapply_rope(llama.apply_rope(k, pos, theta), pos, theta)


class _ZeroValues(llama.KVHook):
    def __call__(self, layer, k, v):
        return k, np.zeros_like(v)


def test_identity_hook_gives_identical_logits(short_window, short_logits):
    assert np.array_equal(llama.forward(short_window, hook=_Unchanged()), short_logits)


def test_pre_rope_round_trip_hook(short_window, short_logits):
    logits = llama.forward(short_window, hook=_RopeRoundTrip())
    # float32 rounding of the extra rotations, carried through 30 layers: ~1e-5 relative.
    assert np.abs(logits - short_logits).max() <= 1e-5 * np.abs(short_logits).max()


def test_hook_output_is_what_attention_reads(short_window, short_logits):
    assert not np.allclose(llama.forward(short_window, hook=_ZeroValues()), short_logits)


def test_capture_kv_layout(model, short_window):
    c = model.config
    kv = llama.capture_kv(short_window)
    assert len(kv) == c.n_layers
    k, v, k_pre = kv[3]
    for a in (k, v, k_pre):
        assert a.shape == (c.n_kv_heads, len(short_window), c.head_dim) and a.dtype == np.float32
    np.testing.assert_allclose(llama.apply_rope(k_pre, np.arange(len(short_window)), c.rope_theta),
                               k, atol=1e-5)


def test_capture_qkv_is_what_attention_reads(model, short_window):
    """capture_qkv's queries are the layer's Q projection of the normed input, turned by RoPE at
    each token's position (checked at layer 0 from the weights); its K and V are capture_kv's."""
    c, T = model.config, len(short_window)
    qkv = llama.capture_qkv(short_window)
    assert len(qkv) == c.n_layers
    q, k, v = qkv[0]
    assert q.shape == (c.n_heads, T, c.head_dim) and q.dtype == np.float32
    k_ref, v_ref, _ = llama.capture_kv(short_window)[0]
    np.testing.assert_array_equal(k, k_ref)
    np.testing.assert_array_equal(v, v_ref)
    x = model.tok_embd[short_window]
    h = llama.rms_norm(x, model.layers[0].attn_norm, c.rms_eps)
    want = (h @ model.layers[0].wq.T).reshape(T, c.n_heads, c.head_dim).transpose(1, 0, 2)
    np.testing.assert_allclose(q, llama.apply_rope(want, np.arange(T), c.rope_theta), atol=1e-4)


def test_rope_is_adjacent_pair_rotation():
    x = np.zeros((1, 2, 4), np.float32)
    x[0, :, 0] = 1.0  # unit vector on the first pair's first axis
    out = llama.apply_rope(x, np.array([0, 1]), theta=100.0)
    np.testing.assert_allclose(out[0, 0], [1, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(out[0, 1], [np.cos(1), np.sin(1), 0, 0], atol=1e-6)


def test_quant_hook_q8_0_barely_moves_perplexity(short_window):
    base = llama.token_nll(short_window).mean()
    q8 = llama.token_nll(short_window, hook=quant.QuantHook("q8_0", "kv")).mean()
    assert q8 != base and abs(q8 - base) < 0.02  # 192 tokens: about +1 % PPL


# ---------------------------------------------------------------- quantisers (no model)

def _block(*head):
    x = np.zeros(32, np.float32)
    x[: len(head)] = head
    return x


def test_q8_0_hand_example():
    # amax 127 -> d = 1 exactly; roundf rounds halves away from zero (2.5 -> 3, -2.5 -> -3).
    x = _block(127, 1.5, 2.5, -2.5, 0.4, -0.6)
    np.testing.assert_array_equal(quant.q8_0(x), _block(127, 2, 3, -3, 0, -1))


def test_q8_0_decodes_with_fp16_scale():
    x = _block(1.0, -0.5)  # d = 1/127 is not an fp16 number; q = 127 and roundf(-63.5) = -64
    d16 = np.float32(np.float16(np.float32(1) / np.float32(127)))
    np.testing.assert_array_equal(quant.q8_0(x), _block(127 * d16, -64 * d16))


def test_q4_0_hand_example():
    # largest magnitude is -8 -> d = -8/-8 = 1; q = min(15, trunc(x + 8.5)); x_hat = q - 8.
    x = _block(-8, 3, 2.5, -2.5, 7.9, 0.49)
    np.testing.assert_array_equal(quant.q4_0(x), _block(-8, 3, 3, -2, 7, 0))


def test_q4_0_takes_the_first_largest_magnitude_with_its_sign():
    # max = +8 (first of the tie) -> d = -1: +8 -> q 0 -> 8, but -8 -> q 16 -> clamped 15 -> -7.
    np.testing.assert_array_equal(quant.q4_0(_block(8, -8)), _block(8, -7))


def test_q4_1_hand_example():
    # min -1, max 14 -> d = 1, m = -1; q = min(15, trunc(x - m + 0.5)); x_hat = q + m.
    x = _block(-1, 14, 1.5, 1.4, 0.0)
    x[5:] = 0.0
    np.testing.assert_array_equal(quant.q4_1(x), _block(-1, 14, 2, 1, 0))


def test_quantisers_match_gguf_reference():
    import gguf
    from gguf import quants

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 64)) * rng.uniform(0.01, 10, (64, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block must decode to zeros
    for name in ("q8_0", "q4_0", "q4_1"):
        qtype = getattr(gguf.GGMLQuantizationType, name.upper())
        expected = quants.dequantize(quants.quantize(x, qtype), qtype)
        np.testing.assert_array_equal(getattr(quant, name)(x), expected, err_msg=name)


def test_bytes_per_vector():
    sizes = {name: quant.bytes_per_vector(name, 64) for name in quant.QUANTISERS}
    assert (sizes["f16"], sizes["q8_0"], sizes["q4_0"], sizes["q4_1"]) == (128, 68, 36, 40)
    assert (sizes["int8_token"], sizes["int4_token"]) == (66, 34)
    assert sizes["mean_q4_0"] == 36 + 128 / 1024  # fp16 mean amortised over the window


def test_mean_subtracted_adds_the_mean_back():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 100, 64)) + 50 * rng.standard_normal(64)).astype(np.float32)
    plain = np.mean((quant.q4_0(x) - x) ** 2)
    centred = np.mean((quant.QUANTISERS["mean_q4_0"][0](x) - x) ** 2)
    assert centred < plain / 10


def test_per_token_int8_and_int4():
    x = np.array([[1.0, -0.5, 0.25] + [0.0] * 61], np.float32)
    np.testing.assert_allclose(quant.int8_token(x), x, atol=1 / 254 + 1e-3)
    s = np.float32(np.float16(np.float32(1) / np.float32(7)))
    np.testing.assert_array_equal(quant.int4_token(x)[0, :3], [7 * s, -4 * s, 2 * s])


def test_quant_hook_targets():
    k = np.linspace(-3, 3, 3 * 4 * 64, dtype=np.float32).reshape(3, 4, 64)
    v = -k
    k2, v2 = quant.QuantHook("q4_0", "v")(0, k, v)
    assert k2 is k and not np.array_equal(v2, v)
    hook = quant.QuantHook("q4_0", "k", keys_pre_rope=True)
    assert not np.array_equal(hook.keys_pre_rope(0, k), k)
    assert hook(0, k, v) == (k, v)


def test_quant_hook_key_order_hf_quantises_in_rotate_half_order():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 4, 64)).astype(np.float32)
    k[..., 1::2] *= 100  # odd GGUF dims = second halves in HF order: separate q4_0 blocks there
    to_hf = llama.rotate_half_order(64)
    np.testing.assert_array_equal(to_hf[[0, 1, 31, 32, 63]], [0, 2, 62, 1, 63])
    hf, _ = quant.QuantHook("q4_0", "k", key_order="hf")(0, k, k)
    np.testing.assert_array_equal(hf[..., to_hf], quant.q4_0(k[..., to_hf]))
    assert not np.array_equal(hf, quant.q4_0(k))


def test_rotate_half_order_maps_adjacent_pair_rope_to_hf_rope():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    pos, theta, p = np.arange(5), 100000.0, llama.rotate_half_order(64)
    angles = pos[:, None] * theta ** (-np.arange(0, 64, 2) / 64)
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., p][..., :32], x[..., p][..., 32:]
    hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    np.testing.assert_allclose(llama.apply_rope(x, pos, theta)[..., p], hf, atol=1e-5)
