"""Which encoder writes an arena's coded streams: the CPU codec or the GPU OMP encoder,
chosen by measurement where it can go either way.

KvArena(encoder="auto") — the default unless $KVDICT_VK_ENCODER says "cpu" or "gpu" — asks
here on a coded layer's append. On a CPU driver the answer is the CPU codec without a
measurement: there the "GPU" is the same cores behind a per-lane loop, and the committed
figures have the codec an order of magnitude ahead (docs/results/lavapipe: `kvdict-bench
encode`). On a GPU it depends on the format and the batch — the committed H200 figures have
the GPU encoder ahead with a residual stage and behind without one — so the first append
of each (device, stream format, batch-size bucket) times both on a sample of the rows being
appended — the GPU encoder as the arena runs it, into a device buffer without read-back, once
untimed first (pipelines, clocks) — and keeps the faster, per process; with
$KVDICT_VK_TUNE_CACHE also across processes (choice_store: keyed by the device, driver, the
encoder's SPIR-V and the host CPU besides the format and bucket).
"""
from __future__ import annotations

import time

from .. import choice_store, shader_build

SAMPLE_TOKENS = 256  # tokens per KV head timed (at most: an append of fewer times all it has)
STORE_KIND = "encoder"  # these choices in choice_store
ENCODERS = ["cpu", "gpu"]  # the candidates, as stored
# the GPU encoder's SPIR-V: a rebuilt encoder is timed anew
ENCODER_VARIANTS = tuple(v for v in shader_build.VARIANTS if v.startswith("omp_encode_"))

# (device identity, format of the layer's coded streams, head_dim, n_atoms, batch bucket) → "cpu" | "gpu"
_CHOICES: dict[tuple, str] = {}
# the same key → the seconds a measurement took, by part (for reports: measurements())
_SECONDS: dict[tuple, dict] = {}


def _bucket(n_tokens: int) -> int:
    b = 1
    while b < min(n_tokens, SAMPLE_TOKENS):
        b *= 2
    return b


def choose(memory, layer: int, rows, stream_dict, gpu_encoder) -> str:
    """"cpu" or "gpu" for appending ``rows`` ((K, V), each (n_kv, T, head_dim) float32) to
    ``layer`` (which has coded streams) of the arena whose memory is ``memory`` (an
    ArenaMemory: its device and layout). What a measurement runs, given explicitly:
    ``stream_dict(layer, stream)`` the dictionary a coded stream ("k" / "v") encodes with
    (the codec's side), ``gpu_encoder(layer, stream_layout)`` the arena's GPU encoder of it."""
    lay = memory.layout.layers[layer]
    coded = [(st, r) for st, r in zip(lay.streams, rows) if st.coded]
    fmt = tuple((st.stream, st.sparsity, st.residual_bits, st.n_dict_heads) for st, _ in coded)
    key = choice_store.device_identity(memory.device, ENCODER_VARIANTS) + (
        choice_store.host_cpu(), fmt, memory.layout.head_dim, memory.layout.n_atoms, _bucket(rows[0].shape[1]))
    if key not in _CHOICES:
        if memory.device.is_cpu:  # not measured, so not stored
            _CHOICES[key] = "cpu"
        elif (stored := choice_store.load(STORE_KIND, key, ENCODERS)) is not None:
            _CHOICES[key] = stored
        else:
            _SECONDS[key] = _measure(memory.device, layer, coded, stream_dict, gpu_encoder)
            _CHOICES[key] = "gpu" if _SECONDS[key]["gpu_s"] < _SECONDS[key]["cpu_s"] else "cpu"
            choice_store.save(STORE_KIND, key, ENCODERS, _CHOICES[key])
    return _CHOICES[key]


def _measure(device, layer: int, coded, stream_dict, gpu_encoder) -> dict:
    """Both on a sample: the codec, and the GPU encoder as the arena runs it (encode_into a
    device buffer, no read-back) into a scratch buffer of the sample's slots — their seconds
    over the layer's coded streams ("cpu_s", "gpu_s"), and the untimed first GPU run's
    ("gpu_first_s": pipelines made, clocks up)."""
    from ... import codec
    from ..kernels import Buffer
    cpu = gpu = gpu_first = 0.0
    for st, r in coded:
        sample = r[:, :SAMPLE_TOKENS]
        d, enc = stream_dict(layer, st.stream), gpu_encoder(layer, st)
        t = time.perf_counter()
        codec.encode_heads(sample, d)
        cpu += time.perf_counter() - t
        n_kv, n_tok = sample.shape[:2]
        scratch = Buffer(device, n_kv * n_tok * enc.slot_words, "storage", "encoder choice scratch")
        try:
            t = time.perf_counter()
            enc.encode_into(scratch, sample, 0, n_tok, 0)  # not compared: pipelines made, clocks up
            gpu_first += time.perf_counter() - t
            t = time.perf_counter()
            enc.encode_into(scratch, sample, 0, n_tok, 0)
            gpu += time.perf_counter() - t
        finally:
            scratch.destroy()
    return {"cpu_s": cpu, "gpu_s": gpu, "gpu_first_s": gpu_first}


def measured() -> dict:
    """What was chosen in this process, CPU drivers' unmeasured answers included (for reports)."""
    return dict(_CHOICES)


def measurements() -> dict:
    """What the choices measured in this process (not those read from the store or
    unmeasured): {key: {"cpu_s", "gpu_s", "gpu_first_s"}}."""
    return {key: dict(parts) for key, parts in _SECONDS.items()}
