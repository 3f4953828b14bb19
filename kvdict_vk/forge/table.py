"""The fidelity table: every cache — dictionaries and the quantisers a user would pick
instead — measured on the same windows of every evaluation text, paired against the f32
cache, at its true bytes per head vector.

Each row is measured per text and cached under <cache>/rows/<text key>.json by the row's
identity (its name plus, for learned rows, a digest of what was learned), so a rerun of
the forge measures only what changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import errors as E
from . import certify, kivi, llama, quant, rotated, tokenizer
from . import residual_only as R
from .texts import EvalText


@dataclass
class EvalSet:
    """One evaluation text's windows and its f32 baseline NLL."""
    text: EvalText
    windows: list
    sha256: str  # of the text as tokenised (UTF-8)
    file_sha256: str
    base_nll: np.ndarray

    @property
    def key(self) -> str:
        return f"{self.text.name}-{self.sha256[:12]}-{len(self.windows[0])}x{len(self.windows)}"


def load_eval_set(text: EvalText, window: int, n_windows: int | None, cache_dir: str | None) -> EvalSet:
    body = text.text()
    wins = llama.eval_windows(tokenizer.encode(body), window)[: n_windows or text.windows]
    sha = certify.text_sha256(body)
    base = _cached_baseline(wins, sha, cache_dir)
    return EvalSet(text, wins, sha, text.file_sha256(), base)


def _cached_baseline(wins, sha: str, cache_dir: str | None) -> np.ndarray:
    from .gguf_model import load_model
    path = None
    if cache_dir:
        key = hashlib.sha256(repr((load_model().sha256, sha, [len(w) for w in wins])).encode())
        path = os.path.join(cache_dir, f"base-{key.hexdigest()[:16]}.npy")
        if os.path.exists(path):
            return np.load(path)
    nll = certify.baseline_nll(wins)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        np.save(path, nll)
    return nll


@dataclass
class Row:
    name: str
    kind: str  # dictionary | kivi | rotated | residual_only | q8_0
    bytes_per_vector: float
    hook: Callable[[], llama.KVHook]
    identity: str = ""  # what a cached result must match besides the name (learned rows)
    note: str = ""


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if a is not None:
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def baseline_rows(means_scales: list | None, head_dim: int, context: int) -> list[Row]:
    """The quantisers beside the dictionary, most informative first (a run cut short keeps
    the rows it finished)."""
    kb = lambda k, v, r=0: kivi.bytes_per_vector(k, v, r, head_dim, context)  # noqa: E731
    rows = [
        Row("q8_0", "q8_0", quant.bytes_per_vector("q8_0", head_dim), lambda: quant.QuantHook("q8_0")),
        Row("KIVI 5 bit", "kivi", kb(5, 5), lambda: kivi.KiviHook(5, 5)),
        Row("KIVI 4 bit", "kivi", kb(4, 4), lambda: kivi.KiviHook(4, 4)),
        Row("KIVI K5 V4", "kivi", kb(5, 4), lambda: kivi.KiviHook(5, 4)),
        Row("KIVI 3 bit", "kivi", kb(3, 3), lambda: kivi.KiviHook(3, 3)),
        Row("KIVI 2 bit", "kivi", kb(2, 2), lambda: kivi.KiviHook(2, 2)),
        Row("KIVI 4 bit + 128 recent", "kivi", kb(4, 4, 128), lambda: kivi.KiviHook(4, 4, 128)),
        Row("KIVI 2 bit + 128 recent", "kivi", kb(2, 2, 128), lambda: kivi.KiviHook(2, 2, 128)),
        Row("KIVI 3 bit + 32 recent", "kivi", kb(3, 3, 32), lambda: kivi.KiviHook(3, 3, 32)),
        Row("Hadamard + q4_1", "rotated", rotated.bytes_per_vector("q4_1", "q4_1"),
            lambda: rotated.RotatedHook("q4_1", "q4_1")),
        Row("Hadamard + q5_0", "rotated", rotated.bytes_per_vector("q5_0", "q5_0"),
            lambda: rotated.RotatedHook("q5_0", "q5_0")),
    ]
    if means_scales is not None:
        ident = digest(*[a for pair in means_scales for ms in pair for a in ms])
        for k, v, group in ((4, 3, False), (5, 4, False), (4, 4, True)):
            name = f"residual only (s 0) K{k} V{v} b" + (" + group scales" if group else "")
            rows.append(Row(name, "residual_only", R.residual_only_bytes(k, v, group, head_dim),
                            lambda k=k, v=v, g=group: R.ResidualOnlyHook(means_scales, k, v, g), ident))
    return rows


def check_names(known, names) -> None:
    """An unknown row name among ``names`` is a KvDictError that lists the known ones."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise E.KvDictError(f"unknown table row(s) {unknown}; known: {list(known)}")


def select(rows: list[Row], names: tuple | None) -> list[Row]:
    """The rows named (all where ``names`` is None), in the order given (check_names)."""
    if names is None:
        return rows
    by_name = {r.name: r for r in rows}
    check_names(by_name, names)
    return [by_name[n] for n in names]


def measure(rows: list[Row], sets: list[EvalSet], cache_dir: str | None, log=print) -> list[dict]:
    """Every row on every text: [{name, kind, bytes_per_vector, texts: {name: result}}]."""
    out = []
    for row in rows:
        per_text = {}
        for es in sets:
            per_text[es.text.name] = _measure_one(row, es, cache_dir, log)
        out.append(dict(name=row.name, kind=row.kind, bytes_per_vector=float(row.bytes_per_vector),
                        note=row.note, texts=per_text))
    return out


def _measure_one(row: Row, es: EvalSet, cache_dir: str | None, log) -> dict:
    path = os.path.join(cache_dir, "rows", f"{es.key}.json") if cache_dir else None
    key = f"{row.name}|{row.identity}"
    cached = {}
    if path and os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if key in cached:
            return cached[key]
    t0 = time.perf_counter()
    res = certify.evaluate(es.windows, row.hook(), es.base_nll).to_dict()
    res["seconds"] = time.perf_counter() - t0
    log(f"{es.text.name}: {row.name}: ΔPPL {100 * res['delta_rel']:+.2f} % "
        f"[{100 * res['ci95'][0]:+.2f}, {100 * res['ci95'][1]:+.2f}] at {row.bytes_per_vector:.1f} B/vector")
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):  # re-read: another row may have been stored meanwhile
            with open(path) as f:
                cached = json.load(f)
        cached[key] = res
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(tmp, path)
    return res


def write_doc(doc: dict, out: str | None) -> None:
    """A lever tool's JSON document to ``out``, or to stdout when none is given."""
    text = json.dumps(doc, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def markdown(rows: list[dict], sets: list[EvalSet]) -> str:
    """One table per evaluation text, rows by bytes."""
    parts = []
    for es in sets:
        name = es.text.name
        n_tok = len(es.base_nll)
        parts.append(f"### {name} — {es.text.domain} ({len(es.windows)} × {len(es.windows[0])} tokens, "
                     f"{n_tok} scored; f32 PPL {float(np.exp(es.base_nll.mean())):.3f}; sha256 {es.sha256[:16]}…)\n")
        parts.append("| cache | kind | bytes / head vector | ΔPPL | 95 % CI |\n|---|---|---:|---:|---|")
        for r in sorted(rows, key=lambda r: (r["bytes_per_vector"], r["name"])):
            t = r["texts"].get(name)
            if t is None:
                continue
            lo, hi = t["ci95"]
            parts.append(f"| {r['name']} | {r['kind']} | {r['bytes_per_vector']:.1f} | "
                         f"{100 * t['delta_rel']:+.2f} % | [{100 * lo:+.2f}, {100 * hi:+.2f}] % |")
        parts.append("")
    return "\n".join(parts) + "\n"


def fidelity_json(rows: list[dict], sets: list[EvalSet], command: str, default: str) -> dict:
    """docs/results/fidelity.json's shape: ΔPPL as fractions, per text."""
    texts = {}
    for es in sets:
        name = es.text.name
        texts[name] = dict(
            path=es.text.path, domain=es.text.domain, sha256=es.sha256, file_sha256=es.file_sha256,
            windows=len(es.windows), window=len(es.windows[0]), scored_tokens=int(len(es.base_nll)),
            baseline_ppl=float(np.exp(es.base_nll.mean())),
            rows=[dict(name=r["name"], kind=r["kind"], bytes_per_vector=r["bytes_per_vector"],
                       dppl=r["texts"][name]["delta_rel"], ci95=list(r["texts"][name]["ci95"]),
                       **({"note": r["note"]} if r.get("note") else {}))
                  for r in sorted(rows, key=lambda r: (r["bytes_per_vector"], r["name"])) if name in r["texts"]])
    return dict(command=command, default=default, texts=texts)
