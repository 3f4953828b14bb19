"""The forge end to end: capture K/V from calibration text, learn per-stream (per KV head)
dictionaries with a residual stage, certify them on held-out text through the runtime's
own reconstruct-on-write path, and package a framed artifact.

Calibration: every license under /usr/share/common-licenses except the evaluation texts
(files are deduplicated by their real path, so GPL → GPL-3 is excluded too), concatenated
in path order; or the files ``--calib-files`` names (never an evaluation text), their
windows taken in turn — the first window of each file, then the second of each, … — so a
few windows already cover every file.
Evaluation: the texts of forge.texts (GPL-3, the sed FAQ, Python's reference topics),
non-overlapping 1024-token windows from each text's start, each window from position 0.
The gate passes only when the upper end of the 95 % interval is within the threshold on
every text.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .. import artifact as A
from .. import errors as E
from .. import codec, runtime
from ..dictionary import FORGE_N_ATOMS, FORGE_PER_HEAD, FORGE_RESIDUAL_BITS, FORGE_SPARSITY, KvDictArtifact, StreamDict
from ..rope import KeyRope
from ..window import NO_WINDOW, ExactWindow
from . import certify, llama, parallel, table, texts as T, tokenizer
from .gguf_model import load_model
from .learn import learn_stream

LICENSES = "/usr/share/common-licenses"
PRODUCER = {"name": "kvdict-forge", "version": "0.1.0"}


@dataclass
class ForgeConfig:
    n_atoms: int = FORGE_N_ATOMS
    k_sparsity: int = FORGE_SPARSITY
    v_sparsity: int = FORGE_SPARSITY
    # residual stage bits (0 = atoms only). K 6 / V 4 (60 B a head vector): the smallest
    # measured that passes the gate — upper 95 % bound ≤ +1 % — on every evaluation text
    # (K 4 / V 3 at 48 B and K 5 / V 4 at 56 B fail on pydoc: docs/results/fidelity.json)
    k_bits: int = FORGE_RESIDUAL_BITS[0]
    v_bits: int = FORGE_RESIDUAL_BITS[1]
    # one dictionary per KV head, or (the default) one shared by a layer's KV heads: at
    # 1024 atoms both pass the gate with the same ΔPPL within noise, and the shared one is a
    # third of the dictionary memory (docs/FIDELITY.md, "Dictionaries shared by the KV heads")
    per_head: bool = FORGE_PER_HEAD
    iters: int = 6
    method: str = "ksvd"
    train_vectors: int = 4096  # per dictionary, sampled from the calibration K/V
    calib_tokens: int = 4096
    window: int = 1024  # tokens a calibration window holds (and an evaluation window's, by default)
    eval_windows: int | None = None  # windows per text (None: each text's own, forge.texts)
    # tokens an evaluation window holds (None: ``window``): a long-context gate takes 4 096 or
    # more, so a recent window is a few per cent of a window's tokens (forge.texts.LONG_TEXTS)
    eval_window: int | None = None
    texts: tuple = T.DEFAULT_TEXTS  # the gate's evaluation texts
    threshold: float = 0.01  # the gate: upper end of the 95 % CI of ΔPPL ≤ +1 % on every text
    layers: list | None = None  # layers to code (None = all); the rest pass through
    calib_files: tuple | None = None  # calibration text files, windows in turn (None: the licenses)
    passthrough: list = field(default_factory=list)  # ["k:3", "v:0", …] streams left f32
    seed: int = 0
    # atoms rounded to binary16 values (forge.learn): the arena then keeps them in binary16
    # (half the bytes, half reconstruct's loads); False keeps the learner's float32 bits
    f16_atoms: bool = True
    # the exact window the artifact carries and is certified with (kvdict_vk.window): the
    # first window_sink tokens and the window_recent most recent kept in binary16
    window_sink: int = 0
    window_recent: int = 0
    # one dictionary a stream for each run of this many neighbouring layers (0, 1 | 2, 3 | …),
    # learned on their calibration vectors pooled (issue 51's cross-layer sharing, measured);
    # None: a layer's own. The artifact still holds each layer's copy (the engine keeps a
    # layer's atoms in its tail): a measurement of what sharing would cost in fidelity
    layer_share: int | None = None
    # keys coded before RoPE (kvdict_vk.rope): the key dictionaries learned on the keys before
    # RoPE turns them; the artifact records the model's RoPE and the engine turns each decoded
    # key (attend_direct; docs/FIDELITY.md, "Keys coded before RoPE")
    pre_rope_keys: bool = False

    def gate_window(self) -> int:
        """Tokens an evaluation window holds."""
        return self.eval_window or self.window

    def exact_window(self) -> ExactWindow:
        """The artifact's exact window (DimsError when out of range)."""
        return ExactWindow(self.window_sink, self.window_recent)

    def stream_spec(self, k_not_v: bool) -> tuple[int, int]:
        return (self.k_sparsity, self.k_bits) if k_not_v else (self.v_sparsity, self.v_bits)

    def coded(self, layer: int, k_not_v: bool) -> bool:
        if self.layers is not None and layer not in self.layers:
            return False
        return f"{'k' if k_not_v else 'v'}:{layer}" not in self.passthrough


def calibration_files(paths=None) -> list[str]:
    """Real paths of the calibration texts: ``paths`` as given (order kept, duplicates
    dropped), or by default the licenses without the evaluation texts. KvDictError when a
    given file is missing or is an evaluation text (calibration and evaluation stay disjoint)."""
    ev = T.eval_paths()
    if not paths:
        files = {os.path.realpath(os.path.join(LICENSES, f)) for f in os.listdir(LICENSES)}
        return sorted(f for f in files if f not in ev and os.path.isfile(f))
    out = []
    for p in paths:
        real = os.path.realpath(p)
        if not os.path.isfile(real):
            raise E.KvDictError(f"calibration file {p}: not a readable file")
        if real in ev:
            raise E.KvDictError(f"calibration file {p} is an evaluation text; calibration must not read it")
        if real not in out:
            out.append(real)
    return out


def calibration_text(path: str) -> str:
    """A calibration file's text (texts.decode_text: gzip-compressed when named .gz)."""
    with open(path, "rb") as f:
        return T.decode_text(path, f.read())


def calibration_windows(files: list, window: int, n_windows: int, interleave: bool) -> list:
    """The first n_windows calibration windows: of the files' concatenation, or (interleave)
    each file's windows in turn."""
    if not interleave:
        toks: list[int] = []
        for f in files:
            toks += tokenizer.encode(calibration_text(f))
        return llama.eval_windows(toks, window)[:n_windows]
    per_file = [llama.eval_windows(tokenizer.encode(calibration_text(f)), window) for f in files]
    deepest = max(map(len, per_file), default=0)
    wins = [ws[rank] for rank in range(deepest) for ws in per_file if rank < len(ws)]
    if not wins:
        raise E.KvDictError(f"the calibration files hold no {window}-token window")
    return wins[:n_windows]


def calibration_sha256(files: list) -> list:
    """[{path, sha256 of its bytes}], for the certificate."""
    out = []
    for f in files:
        with open(f, "rb") as fh:
            out.append(dict(path=f, sha256=hashlib.sha256(fh.read()).hexdigest()))
    return out


def calibration_kv(n_tokens: int, window: int, log=print, cache_dir: str | None = None, files=None,
                   pre_rope_keys: bool = False) -> list:
    """Per layer (K, V), each (n_kv, T, head_dim) float32, from ≈ n_tokens of calibration
    text (``files``: calibration_files' argument); with ``pre_rope_keys`` (K, V, K before
    RoPE). Cached in cache_dir (keyed by the model, the texts and the sizes) when given."""
    paths, interleave = calibration_files(files), bool(files)  # given files: their windows in turn
    cache = None
    if cache_dir:
        key = hashlib.sha256(repr((load_model().sha256, paths, n_tokens, window,
                                   parallel.learning_core()) + (("interleaved",) if interleave else ())
                                  + (("pre_rope_keys",) if pre_rope_keys else ())).encode())
        cache = os.path.join(cache_dir, f"calib-{key.hexdigest()[:16]}.npz")
        if os.path.exists(cache):
            with np.load(cache) as z:
                log(f"calibration K/V reused from {cache}")
                names = ("k", "v", "kp") if pre_rope_keys else ("k", "v")
                return [tuple(z[f"{n}{i}"] for n in names) for i in range(len(z.files) // len(names))]
    wins = calibration_windows(paths, window, max(1, -(-n_tokens // window)), interleave)
    per_layer = capture_windows(wins, log, pre_rope_keys, what="calibration window")
    if cache:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = cache + ".tmp.npz"
        np.savez(tmp, **{f"{n}{i}": a for i, arrays in enumerate(per_layer) for n, a in zip(("k", "v", "kp"), arrays)})
        os.replace(tmp, cache)
    return per_layer


def learn_configured(cfg: ForgeConfig, log=print, cache_dir: str | None = None, progress=None) -> tuple:
    """(calibration (K, V) per layer, the artifact ``cfg`` learns from them): with
    ``pre_rope_keys`` the key dictionaries learned on the keys before RoPE and the artifact
    recording the model's RoPE (kvdict_vk.rope). ``progress(total)``: a callback per stream."""
    kv = calibration_kv(cfg.calib_tokens, cfg.window, log=log, cache_dir=cache_dir, files=cfg.calib_files,
                        pre_rope_keys=cfg.pre_rope_keys)
    step = progress(len(dictionary_runs(len(kv), cfg))) if progress else None
    if not cfg.pre_rope_keys:
        return kv, learn_artifact(kv, cfg, progress=step)
    art = learn_artifact([(kp, v) for _, v, kp in kv], cfg, progress=step)
    c = load_model().config
    return [(k, v) for k, v, _ in kv], dataclasses.replace(art, key_rope=KeyRope(c.rope_theta, c.rope_dim))


def capture_windows(wins: list, log=print, pre_rope_keys: bool = False, what: str = "window") -> list:
    """Per layer (K, V[, K before RoPE]), each (n_kv, sum of the windows' T, head_dim) float32:
    the model run over each token window, its K/V concatenated along the tokens. Captured in
    the learning workers: the forward's float32 matmuls on the same pinned BLAS kernels as
    learning (forge.parallel), so the vectors do not depend on the CPU."""
    t0 = time.perf_counter()
    caps = parallel.map_tasks(_capture_task, [(w, pre_rope_keys) for w in wins],
                              lambda i: log(f"{what} {i + 1}/{len(wins)} captured "
                                            f"({time.perf_counter() - t0:.1f} s)"))
    return [tuple(np.concatenate([c[li][j] for c in caps], 1) for j in range(len(caps[0][li])))
            for li in range(len(caps[0]))]


def learn_head_stream(x: np.ndarray, cfg: ForgeConfig, k_not_v: bool, seed: int) -> StreamDict:
    """One stream's dictionary from (n_kv, T, hd) calibration vectors: per KV head or shared."""
    s, bits = cfg.stream_spec(k_not_v)
    rng = np.random.default_rng(seed)
    groups = [x[h] for h in range(x.shape[0])] if cfg.per_head else [x.reshape(-1, x.shape[-1])]
    atoms, means, scales = [], [], []
    for g, data in enumerate(groups):
        sel = rng.choice(len(data), size=min(len(data), cfg.train_vectors), replace=False)
        train = data[sel]
        d, _ = learn_stream(train, cfg.n_atoms, s, iters=cfg.iters, method=cfg.method, seed=seed + g,
                            f16_atoms=cfg.f16_atoms)
        atoms.append(d.atoms[0])
        means.append(d.mean[0])
        if bits:
            # Static per-channel scale of the residual stage: the RMS per channel of what
            # the atoms leave (binary16 coefficients included), floored so no channel is 0.
            rec = codec.roundtrip(train, d)
            rms = np.sqrt(np.mean((train - rec) ** 2, axis=0))
            scales.append(np.maximum(rms, 1e-3 * rms.max() + 1e-12))
    return StreamDict(np.stack(atoms), np.stack(means), None, s, bits,
                      np.stack(scales) if bits else None)


def _capture_task(window, pre_rope_keys=False):
    return [(k, v, kp) if pre_rope_keys else (k, v) for k, v, kp in llama.capture_kv(window)]  # plain arrays travel


def _learn_task(x, cfg, k_not_v, seed):
    d = learn_head_stream(x, cfg, k_not_v, seed)
    return d.atoms, d.mean, d.sparsity, d.residual_bits, d.residual_scale  # plain arrays travel


def dictionary_runs(n_layers: int, cfg: ForgeConfig) -> list[tuple[list, int]]:
    """The dictionaries ``cfg`` learns: (its coded layers, stream j: 0 K, 1 V) each — one a
    coded (layer, stream), or with ``layer_share`` L one a stream for layers [L·i, L·i + L)."""
    share = 1 if cfg.layer_share is None else cfg.layer_share
    if share < 1:
        raise E.DimsError(f"layer_share {cfg.layer_share}: at least 1")
    runs = []
    for l0 in range(0, n_layers, share):
        for j, k_not_v in enumerate((True, False)):
            group = [li for li in range(l0, min(l0 + share, n_layers)) if cfg.coded(li, k_not_v)]
            if group:
                runs.append((group, j))
    return runs


def learn_artifact(kv: list, cfg: ForgeConfig, progress=None) -> KvDictArtifact:
    """Every dictionary of :func:`dictionary_runs`, learned in worker processes (see
    forge.parallel) on its layers' calibration vectors (pooled where they are several)."""
    tasks, where = [], dictionary_runs(len(kv), cfg)
    for group, j in where:  # x (n_kv, T · layers, hd)
        x = np.concatenate([kv[li][j] for li in group], axis=1) if len(group) > 1 else kv[group[0]][j]
        tasks.append((x, cfg, j == 0, cfg.seed + 2 * group[0] + j))
    # BLAS pinned to one thread in-process too: its reductions then run in one fixed order,
    # so the bytes learned do not depend on the machine's core count (forge.parallel).
    with parallel.blas_threads(1):
        results = parallel.map_tasks(_learn_task, tasks, progress)
    layers = [[None, None] for _ in kv]
    for (group, j), (atoms, mean, s, bits, scale) in zip(where, results):
        for li in group:
            layers[li][j] = StreamDict(atoms, mean, None, s, bits, scale)
    head_dim = kv[0][0].shape[-1]
    s_max = max(max(cfg.k_sparsity, cfg.v_sparsity), 1)
    return KvDictArtifact(head_dim, cfg.n_atoms, s_max, [tuple(p) for p in layers], cfg.exact_window())


class RuntimeHook(llama.KVHook):
    """The certified path: K/V go through runtime.reconstruct_kv — the engine's own
    reconstruct-on-write, quality-identical to storing codes and reconstructing on read —
    with ``window``'s tokens read in binary16 instead (llama's per-query exact mask)."""

    def __init__(self, window: ExactWindow = NO_WINDOW):
        self.window = window
        self.exact_sink, self.exact_recent = window.sink, window.recent

    def __call__(self, layer, k, v):
        out = []
        for k_not_v, x in ((True, k), (False, v)):
            rows = np.ascontiguousarray(x.transpose(1, 0, 2))  # [token][kv head][dim]
            runtime.reconstruct_kv(layer, k_not_v, rows, x.shape[0], n_tokens=x.shape[1], t0=0)  # windows from 0
            out.append(rows.transpose(1, 0, 2))
        return out[0], out[1]


def eval_sets(cfg: ForgeConfig, cache_dir: str | None = None) -> list[table.EvalSet]:
    """Each evaluation text's windows and f32 baseline NLL (cached in cache_dir)."""
    return [table.load_eval_set(t, cfg.gate_window(), cfg.eval_windows, cache_dir) for t in T.get(cfg.texts)]


def certify_artifact(art: KvDictArtifact, sets: list, hook: RuntimeHook | None = None) -> dict:
    """Paired ΔPPL of the installed-and-enabled artifact on every evaluation text
    (process-wide runtime state), with the artifact's exact window: {text name: PairedResult}.
    The candidate has no certificate yet — measuring it is how it gets one."""
    runtime.enable(art, allow_uncertified=True)
    try:
        return {es.text.name: certify.evaluate(es.windows, hook or RuntimeHook(art.window), es.base_nll)
                for es in sets}
    finally:
        runtime.deactivate()


def gate_passes(upper_bounds, threshold: float) -> bool:
    """The rule, on each text's upper end of the 95 % interval: within the threshold on every
    text (and at least one text)."""
    upper_bounds = list(upper_bounds)
    return bool(upper_bounds) and all(u <= threshold for u in upper_bounds)


def gate_passed(results: dict, threshold: float) -> bool:
    """The gate on a run's results ({text: PairedResult})."""
    return gate_passes((r.ci95[1] for r in results.values()), threshold)


def bytes_per_vector(art: KvDictArtifact, head_dim: int) -> dict:
    """Honest storage per cached head vector: the average over every stream (passthrough
    streams at f32) — every token of the window is coded, none is kept exact."""
    per_stream = [4 * (head_dim if d is None else d.slot_words) for pair in art.layers for d in pair]
    k = [4 * (head_dim if p[0] is None else p[0].slot_words) for p in art.layers]
    v = [4 * (head_dim if p[1] is None else p[1].slot_words) for p in art.layers]
    return dict(all=float(np.mean(per_stream)), k=float(np.mean(k)), v=float(np.mean(v)),
                dictionary_bytes=art.nbytes())


def windowed_bytes(coded: float, context: int, head_dim: int, window: ExactWindow) -> float:
    """Bytes per head vector over ``context`` tokens: ``coded`` a token, plus ``window``'s
    binary16 rows beside the slots (the arena keeps both: docs/ARENA.md) spread over them."""
    return coded + min(window.rows, context) * 2 * head_dim / context


def make_cert(results: dict, cfg: ForgeConfig, sets: list, art: KvDictArtifact) -> A.CertInfo:
    """The certificate: the header's gate numbers are the worst text's (by upper bound);
    extra.texts holds every text's numbers and hashes."""
    m = load_model()
    c = m.config
    worst_name = max(results, key=lambda n: results[n].ci95[1])
    worst = results[worst_name]
    per_text = [dict(name=es.text.name, path=es.text.path, sha256=es.sha256, file_sha256=es.file_sha256,
                     windows=len(es.windows), eval_tokens=results[es.text.name].eval_tokens,
                     baseline_ppl=results[es.text.name].baseline_ppl, coded_ppl=results[es.text.name].coded_ppl,
                     value=results[es.text.name].delta_rel, ci95=list(results[es.text.name].ci95))
                for es in sets]
    # One hash naming the whole evaluation set: SHA-256 over "name:sha256" lines in order.
    set_sha = hashlib.sha256("\n".join(f"{t['name']}:{t['sha256']}" for t in per_text).encode()).hexdigest()
    return A.CertInfo(
        kind=A.KIND, passed=gate_passed(results, cfg.threshold), metric="delta_ppl_rel", value=worst.delta_rel,
        threshold=cfg.threshold, baseline_ppl=worst.baseline_ppl, coded_ppl=worst.coded_ppl,
        eval_tokens=sum(r.eval_tokens for r in results.values()), eval_text_sha256=set_sha, payload_sha256="",
        model=dict(name="SmolLM2-135M-Instruct", gguf_sha256=m.sha256, n_layers=c.n_layers,
                   n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, n_ctx=c.context_length),
        producer=dict(PRODUCER, config=_jsonable(dataclasses.asdict(cfg)), config_key=config_key(cfg),
                      bytes_per_vector=bytes_per_vector(art, c.head_dim),
                      memory=cert_memory(art, c.n_layers, c.n_kv_heads, c.head_dim, c.context_length),
                      blas_core=parallel.learning_core() or "native"),  # the kernels it was learned on
        extra=dict(ci95=list(worst.ci95), worst_text=worst_name, windows=sum(len(es.windows) for es in sets),
                   window=cfg.gate_window(), gate_rule="upper end of the 95 % CI <= threshold on every text",
                   texts=per_text, calibration=calibration_sha256(calibration_files(cfg.calib_files))),
    )


def cert_memory(art: KvDictArtifact, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int) -> dict:
    """The whole arena (regions + tails) of this dictionary's cache at the model's context and
    at 32 k and 128 k tokens, bytes per head vector effective there, and the f16 cache's arena
    (kvdict_vk.memory_report). An optional producer field: readers ignore it when absent."""
    from ..memory_report import arena_memory, report_lengths
    at = arena_memory(n_layers, n_kv_heads, head_dim, art, report_lengths(None, n_ctx))
    return dict(n_ctx=int(n_ctx), arena_bytes={str(a.n_ctx): a.arena_bytes for a in at},
                tail_bytes=at[0].tail_bytes, f16_arena_bytes={str(a.n_ctx): a.f16_arena_bytes for a in at},
                effective_bytes_per_vector={str(a.n_ctx): a.effective_bytes_per_vector for a in at})


def dict_row_name(cfg: ForgeConfig) -> str:
    """The fidelity table's name of a dictionary configuration: "dict N atoms, …" with one
    dictionary per KV head, "dict N shared atoms, …" with one a layer's KV heads share;
    " + L layers a dictionary" with dictionaries shared by L neighbouring layers, " + sink S +
    R recent" with an exact window."""
    shared = "" if cfg.per_head else "shared "
    w = cfg.exact_window()
    layers = f" + {cfg.layer_share} layers a dictionary" if (cfg.layer_share or 1) > 1 else ""
    window = (f" + sink {w.sink}" if w.sink else "") + (f" + {w.recent} recent" if w.recent else "")
    pre = ", keys before RoPE" if cfg.pre_rope_keys else ""
    return (f"dict {cfg.n_atoms} {shared}atoms, K {cfg.k_sparsity}+{cfg.k_bits} b, "
            f"V {cfg.v_sparsity}+{cfg.v_bits} b{pre}{layers}{window}")


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if v is not None}


def config_key(cfg: ForgeConfig) -> str:
    """Identity of what a config learns (for reuse of an artifact by the demo)."""
    blob = repr(sorted(_jsonable(dataclasses.asdict(cfg)).items())) + load_model().sha256 \
        + (parallel.learning_core() or "native")  # other BLAS kernels learn other bytes
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
