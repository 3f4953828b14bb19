"""kvdict-forge: learn, certify and package a KV dictionary for SmolLM2-135M.

    kvdict-forge                       # defaults: a certified artifact in a few minutes
    kvdict-forge --k-bits 0 --v-bits 0 --k-sparsity 8 --v-sparsity 8   # plain atoms
    kvdict-forge --smoke               # CI: 2 layers, small windows
    kvdict-forge --eval-window 4096 --eval-windows 3 --texts sedfaq,pydoc,cmake   # the long-context gate
    kvdict-forge --sink 1 --recent 32  # an artifact with an exact window, certified with it
    kvdict-forge --pre-rope-keys 1     # keys coded before RoPE (the engine turns each decoded key)
    kvdict-forge curve                 # the ΔPPL-vs-bytes sweep (long; see --help)

Writes <out>/<name>.q42art (passed = true or false), <name>.json, <name>.md and <name>.png; with
the baselines, <name>-ranking.json too: the certified caches the engine keeps ranked by their
whole arena at the model's context, and the winner (forge.ranking).
Exit status: 0 when the gate passed, 1 when it failed (the refused artifact is still
written so the refusal can be seen), 2 on usage or input errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .. import artifact as A
from .. import errors as E
from ..memory_report import MODEL_N_CTX
from . import levers, pipeline as P, ranking, report, table
from .gguf_model import load_model


def _progress(total: int, what: str):
    """A tqdm bar on a terminal, a line per step otherwise (logs go to stderr)."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total, desc=what, file=sys.stderr)
        return lambda i: bar.update(1)
    return lambda i: print(f"[forge] {what}: {i + 1}/{total}", file=sys.stderr, flush=True)


def _log(msg: str) -> None:
    print(f"[forge] {msg}", file=sys.stderr, flush=True)


def config_from_args(a) -> P.ForgeConfig:
    cfg = P.ForgeConfig()
    for f in dataclasses.fields(cfg):
        v = getattr(a, f.name, None)
        if v is not None:
            setattr(cfg, f.name, v)
    if a.smoke:
        cfg.layers = cfg.layers or [0, 1]
        cfg.calib_tokens, cfg.train_vectors, cfg.iters = 512, 512, 2
        cfg.n_atoms = min(cfg.n_atoms, 128)
        cfg.window, cfg.eval_windows = 256, 1
    cfg.exact_window()  # out of range: refused before anything is learned
    return cfg


def build(cfg: P.ForgeConfig, out: str, name: str, with_baselines: bool = True,
          command: str = "kvdict-forge", table_rows: tuple | None = None, show: bool = True) -> tuple[int, dict]:
    """Learn, certify and package ``cfg``'s dictionary into ``out``; with_baselines: measure
    the other caches' rows too (``table_rows``: only those named) and rank the certified ones
    (<name>-ranking.json); ``show``: print the table to stdout."""
    if with_baselines and table_rows is not None:  # a misspelt row refused before the minutes of learning
        # (the rows' names do not depend on the head_dim or the statistics given here)
        names = [r.name for r in table.baseline_rows([], 64, cfg.gate_window())] + levers.dictionary_row_names(cfg)
        table.check_names(names, table_rows)
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    cache = os.path.join(out, "cache")
    kv, art = P.learn_configured(cfg, _log, cache, progress=lambda total: _progress(total, "learning streams"))
    t_learn = time.perf_counter() - t0
    sets = P.eval_sets(cfg, cache)
    _log("gate: " + ", ".join(f"{es.text.name} {len(es.windows)} × {cfg.gate_window()}" for es in sets) + " tokens")
    results = P.certify_artifact(art, sets)
    cert = P.make_cert(results, cfg, sets, art)
    path = os.path.join(out, f"{name}.q42art")
    A.write_artifact(path, art, cert)
    bpv = P.bytes_per_vector(art, art.head_dim)
    # the window's tokens charged as the lever rows charge theirs (levers.dictionary_rows)
    row_bytes = P.windowed_bytes(bpv["all"], cfg.gate_window(), art.head_dim, art.window)
    for n, res in results.items():
        _log(f"{n}: ΔPPL {100 * res.delta_rel:+.2f} % (95 % CI {100 * res.ci95[0]:+.2f} … {100 * res.ci95[1]:+.2f} %)")
    _log(f"at {row_bytes:.1f} B/vector (exact window: {art.window.describe()}): "
         f"{'PASSED' if cert.passed else 'FAILED'} the gate "
         f"(upper 95 % bound ≤ +{100 * cfg.threshold:g} % on every text)")
    dict_name = P.dict_row_name(cfg)
    rows = [dict(name=dict_name, kind="dictionary", bytes_per_vector=row_bytes, note="certified (this artifact)",
                 texts={n: r.to_dict() for n, r in results.items()})]
    if with_baselines:
        candidates = table.baseline_rows(levers.residual_stats(kv), art.head_dim, cfg.gate_window()) + \
            levers.dictionary_rows(art, cfg, bpv["all"])
        rows += table.measure(table.select(candidates, table_rows), sets, cache, log=_log)
    ranked = None
    if with_baselines:  # the certified caches ranked by their whole arena at the model's context
        c = load_model().config
        ranked = ranking.rank(rows, (c.n_layers, c.n_kv_heads, c.head_dim), cert.model.get("n_ctx") or MODEL_N_CTX,
                              cfg.threshold, caches={dict_name: art})
        ranked["default"] = _default_cache(ranked, dict_name, path, (c.n_layers, c.n_kv_heads, c.head_dim))
        report.summary_json(os.path.join(out, f"{name}-ranking.json"), ranked)
        _log(f"winner: {ranked['winner']} — {ranked['reason']}")
    summary = dict(artifact=path, passed=cert.passed, gate={n: r.to_dict() for n, r in results.items()},
                   bytes_per_vector=dict(bpv, certified_row=row_bytes), config=dataclasses.asdict(cfg),
                   learn_seconds=t_learn, total_seconds=time.perf_counter() - t0, rows=rows, ranking=ranked)
    report.summary_json(os.path.join(out, f"{name}.json"), summary)
    report.summary_json(os.path.join(out, f"{name}-fidelity.json"),
                        table.fidelity_json(rows, sets, command, dict_name))
    md = table.markdown(rows, sets)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    if with_baselines and show:
        print(md)
    report.plot_texts(rows, sets, os.path.join(out, f"{name}.png"))
    return (0 if cert.passed else 1), summary


def _default_cache(ranked: dict, dict_name: str, artifact: str, shapes) -> dict | None:
    """The winner as KvArena takes it: {"cache": "dict", "artifact": path} (the certified
    artifact), {"cache": "kivi", "kivi": KiviSpec's fields}, {"cache": "q8_0"}; None when no
    cache passes."""
    if ranked["winner"] is None:
        return None
    if ranked["winner"] == dict_name:
        return dict(cache="dict", artifact=artifact)
    cache, spec = ranking.engine_cache(ranked["winner"], shapes)
    return dict(cache=cache, **({"kivi": dataclasses.asdict(spec)} if spec is not None else {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvdict-forge", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("command", nargs="?", default="build", choices=["build", "curve"])
    ap.add_argument("--out", default="out/forge")
    ap.add_argument("--name", default="smollm2")
    ap.add_argument("--smoke", action="store_true", help="tiny run for CI (2 layers, 256-token window)")
    ap.add_argument("--no-baselines", action="store_true")
    for f in dataclasses.fields(P.ForgeConfig):
        if f.name in ("layers", "passthrough", "texts", "calib_files", "window_sink", "window_recent"):
            continue
        kind = type(f.default) if f.default is not None else int
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind if kind is not bool else _bool, default=None)
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated layers to code (the others pass through)")
    ap.add_argument("--passthrough", type=lambda s: s.split(","), default=None,
                    help="streams left f32, e.g. k:0,v:3")
    ap.add_argument("--calib-files", type=lambda s: tuple(s.split(",")), default=None,
                    help="calibration text files (comma-separated; .gz read as gzip), their windows "
                         "taken in turn (default: the licenses but GPL-3, concatenated)")
    ap.add_argument("--texts", type=lambda s: tuple(s.split(",")), default=None,
                    help="evaluation texts (default gpl3,sedfaq,pydoc; the long-context gate's: sedfaq,pydoc,cmake; "
                         "see kvdict_vk/forge/texts.py)")
    ap.add_argument("--sink", dest="window_sink", type=int, default=None,
                    help="exact window: the first N tokens kept in binary16 beside their slots (default 0)")
    ap.add_argument("--recent", dest="window_recent", type=int, default=None,
                    help="exact window: the N most recent tokens kept in binary16 (default 0); the artifact "
                         "carries the window and is certified with it (kvdict_vk/window.py)")
    ap.add_argument("--table-rows", type=lambda s: tuple(x.strip() for x in s.split(";") if x.strip()), default=None,
                    help="only these rows beside the dictionary, by name, ';'-separated (default: every one)")
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--curve-atoms", type=ints, default=None, help="curve: atom counts (default 1024,4096,16384)")
    ap.add_argument("--curve-sparsities", type=ints, default=None, help="curve: sparsities (default 4,6,8,12,16,24)")
    ap.add_argument("--curve-plain-only", action="store_true",
                    help="curve: skip relearning the residual-stage configurations")
    a = ap.parse_args(argv)
    try:
        cfg = config_from_args(a)
        if a.command == "curve":
            if cfg.exact_window():  # its rows are measured without one: a window would only rename them
                raise E.KvDictError("--sink/--recent apply to build; curve measures caches without an exact window")
            if cfg.pre_rope_keys:
                raise E.KvDictError("--pre-rope-keys applies to build; curve learns on the keys after RoPE")
            from . import curve
            return curve.run_curve(cfg, a.out, log=_log, atoms=a.curve_atoms or curve.ATOMS,
                                   sparsities=a.curve_sparsities or curve.SPARSITIES,
                                   residual_configs=() if a.curve_plain_only else curve.RESIDUAL_CONFIGS)
        command = " ".join(["kvdict-forge"] + list(sys.argv[1:] if argv is None else argv))
        # --smoke measures no other cache unless rows are named
        baselines = not a.no_baselines and (not a.smoke or a.table_rows is not None)
        code, _ = build(cfg, a.out, a.name, with_baselines=baselines, command=command, table_rows=a.table_rows)
        return code
    except E.KvDictError as e:
        print(f"kvdict-forge: {e}", file=sys.stderr)
        return 2


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {s}")


if __name__ == "__main__":
    sys.exit(main())
