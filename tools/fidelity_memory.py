"""Add each fidelity row's memory at SmolLM2's context and at 32 k / 128 k tokens (issue 51).

    python tools/fidelity_memory.py [--file docs/results/fidelity.json] [--merge RUN-fidelity.json
                                    [--default NAME]]

For every row of every text in docs/results/fidelity.json this adds, from
``kvdict_vk.memory_report.arena_memory`` (the layer buffers ``kvdict_vk.layout.build_layout``
computes) for SmolLM2-135M's shapes (30 layers, 3 KV heads, head_dim 64):

* ``"effective_bytes_per_vector": {"8192": …, "32768": …, "131072": …}`` — the whole arena
  (regions + tails) at that many tokens over n_layers · n_kv_heads · 2 · tokens head vectors:
  the dictionaries, KIVI statistics and exact windows amortised over the tokens;
* ``"arena_bytes": {"8192": …}`` — the whole arena at the model's context;
* ``"memory_model"`` — "engine" when the row's cache is one the engine keeps (the arena is
  exactly KvArena's), else how it was modelled (a lever the engine does not run: an engine
  layout plus the bytes the lever adds, stated);
* ``"passes"`` — whether the configuration passes the forge's gate: the upper end of its 95 %
  interval within ``ForgeConfig.threshold`` on every text of the file.

``--merge`` first adds the rows of another forge run's fidelity file — measured on the same
texts and windows (each text's file hash, window length and window count must match, else
it stops) — replacing rows of the same name, each merged row carrying that run's
``"command"``; ``--default`` names the file's default row (the forge's default
configuration).

A row's configuration is read from its name (the forge's table names them by their
settings: ``KIVI 4 bit + 128 recent``, ``KIVI K5 V4``, ``dict 1024 atoms, K 4+6 b, V 4+4 b``,
``residual only (s 0) K4 V3 b``, ``Hadamard + q4_1``, ``q8_0``); an unknown name stops the
script. The file's ``"memory"`` records the command and the model's shapes. Idempotent.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvdict_vk import memory_report as M  # noqa: E402
from kvdict_vk.forge import ranking  # noqa: E402
from kvdict_vk.forge.pipeline import ForgeConfig, gate_passes  # noqa: E402

MODEL = dict(name="SmolLM2-135M", n_layers=30, n_kv_heads=3, head_dim=64, n_ctx=M.MODEL_N_CTX)
LENGTHS = M.REPORT_LENGTHS  # 8192, 32768, 131072
GATE = ForgeConfig().threshold  # the upper 95 % bound of ΔPPL on every text


def cache_of(row: dict, shapes=(MODEL["n_layers"], MODEL["n_kv_heads"], MODEL["head_dim"])):
    """(cache description for memory_report, memory_model) of a fidelity row (forge.ranking)."""
    try:
        return ranking.cache_of(row["name"], float(row["bytes_per_vector"]), shapes)
    except ValueError as e:
        raise SystemExit(f"fidelity_memory: {e}") from None


def add_memory(doc: dict, command: str) -> dict:
    shapes = (MODEL["n_layers"], MODEL["n_kv_heads"], MODEL["head_dim"])
    uppers: dict = {}  # row name → its upper bounds over the texts
    for text in doc["texts"].values():
        for row in text["rows"]:
            uppers.setdefault(row["name"], []).append(row["ci95"][1])
    for text in doc["texts"].values():
        for row in text["rows"]:
            cache, how = cache_of(row, shapes)
            at = M.arena_memory(*shapes, cache, LENGTHS)
            row["effective_bytes_per_vector"] = {str(a.n_ctx): a.effective_bytes_per_vector for a in at}
            row["arena_bytes"] = {str(at[0].n_ctx): at[0].arena_bytes}
            row["memory_model"] = how
            row["passes"] = gate_passes(uppers[row["name"]], GATE)
    doc["memory"] = dict(
        command=command, model=MODEL, lengths=list(LENGTHS),
        notes=["effective_bytes_per_vector[N] = the whole arena at N tokens (regions + tails + padding, "
               "kvdict_vk.memory_report.arena_memory over kvdict_vk.layout.build_layout's layer buffers) / "
               "(n_layers * n_kv_heads * 2 * N)",
               "bytes_per_vector is the forge's figure at the gate's 1024-token windows (an exact window "
               "charged at that context); the memory fields are the arena's at N tokens",
               "memory_model 'engine': the arena KvArena allocates for that cache; 'modelled: …' a lever "
               "the engine does not run, as stated"])
    return doc


SAME_WINDOWS = ("file_sha256", "window", "windows")  # what makes two runs' rows comparable


def merge(doc: dict, run: dict, default: str | None = None) -> dict:
    """``run``'s rows (another forge run's fidelity file) into ``doc``, text by text."""
    if set(run["texts"]) != set(doc["texts"]):
        raise SystemExit(f"fidelity_memory: the runs' texts differ: {sorted(run['texts'])} vs {sorted(doc['texts'])}")
    for name, text in run["texts"].items():
        mine = doc["texts"][name]
        for key in SAME_WINDOWS:
            if text.get(key) != mine.get(key):
                raise SystemExit(f"fidelity_memory: text {name}: {key} {text.get(key)!r} differs from {mine.get(key)!r}")
        names = {r["name"] for r in text["rows"]}
        mine["rows"] = [r for r in mine["rows"] if r["name"] not in names] + \
            [dict(r, command=run["command"]) for r in text["rows"]]
    if default is not None:
        if not all(any(r["name"] == default for r in t["rows"]) for t in doc["texts"].values()):
            raise SystemExit(f"fidelity_memory: no row {default!r} in every text")
        doc["default"] = default
    return doc


def _shown(p: Path) -> str:
    """The file as a command names it: relative to the repository where it is inside."""
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default=str(ROOT / "docs" / "results" / "fidelity.json"))
    ap.add_argument("--merge", type=Path, default=None, help="another forge run's fidelity file: its rows added")
    ap.add_argument("--default", default=None, help="the row the file names its default")
    a = ap.parse_args(argv)
    p = Path(a.file)
    doc = json.loads(p.read_text())
    if a.merge is not None:
        doc = merge(doc, json.loads(a.merge.read_text()), a.default)
    elif a.default is not None:
        raise SystemExit("fidelity_memory: --default goes with --merge")
    doc = add_memory(doc, "python tools/fidelity_memory.py --file " + _shown(p))
    p.write_text(json.dumps(doc, indent=1))  # the forge writes it so (no final newline)
    seen = set()
    for row in next(iter(doc["texts"].values()))["rows"]:
        if row["name"] not in seen:
            seen.add(row["name"])
            e = row["effective_bytes_per_vector"]
            print(f"{row['name']:<55} {row['bytes_per_vector']:6.1f} B  effective {e['8192']:7.2f} / "
                  f"{e['32768']:7.2f} / {e['131072']:7.2f} B  arena@8192 {row['arena_bytes']['8192'] / 2 ** 20:7.2f} MiB",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
