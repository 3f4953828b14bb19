"""Rewrite README.md's speed figures from the committed results they cite.

    python tools/refresh_readme_figures.py [--check]

After a new `kvdict-bench` run is committed under docs/results/<device>/, every figure of
README.md's speed section that names its source (`59.2 ms<!-- lavapipe rows[...].gpu_s -->`)
gets the source's current value, written to the same number of decimals (and the same
thousands grouping) as before. The convention and its parser are tests/test_readme_figures.py's
(loaded from there: the test owns them); the prose around the figures is yours to re-read.
--check: change nothing, exit 1 when a figure is out of date.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _convention():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "tests" / "test_readme_figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _format(value: float, like: str) -> str:
    """value written like ``like`` (its decimals, its thousands separator)."""
    sep = next((c for c in like if c in " \u2009\u202f\u00a0,"), None)
    decimals = len(like.split(".")[1]) if "." in like else 0
    text = f"{value:,.{decimals}f}"
    return text.replace(",", sep) if sep else text.replace(",", "")


def refresh(readme: str, conv) -> tuple[str, int]:
    section = conv.speed_section(readme)
    start = readme.index(section)
    out, changed, pos = [], 0, 0
    hidden = [m.span() for m in conv.COMMENT.finditer(section)] + [m.span() for m in conv.FENCE.finditer(section)]
    for m in conv.FIGURE.finditer(section):
        if m.group("ref") is None or any(a <= m.start() < b for a, b in hidden):
            continue
        unit = "×" if m.group("ratio") else m.group("unit")
        value, _ = conv.source_value(m.group("ref").strip(), conv.RESULTS)
        new = _format(value / conv.UNITS[unit][1], m.group("num"))
        if new != m.group("num"):
            changed += 1
        out.append(section[pos:m.start("num")] + new)
        pos = m.end("num")
    out.append(section[pos:])
    return readme[:start] + "".join(out) + readme[start + len(section):], changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report only; exit 1 when a figure is stale")
    a = ap.parse_args(argv)
    path = ROOT / "README.md"
    new, changed = refresh(path.read_text(), _convention())
    print(f"{changed} figure(s) {'out of date' if a.check else 'rewritten'}", file=sys.stderr)
    if not a.check:
        path.write_text(new)
    return 1 if a.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
