"""Rewrite the docs' sourced figures from the committed results they cite.

    python tools/refresh_readme_figures.py [--check] [PAGE ...]

After a new `kvdict-bench` run is committed under docs/results/<device>/, every figure that
names its source (`59.2 ms<!-- lavapipe rows[...].gpu_s -->`) in README.md,
docs/BENCHMARKS.md and every other page the test checks (docs/*.md, lab/*.md; or only the
PAGEs given, paths from the repository root) gets the source's current value, written to
the same number of decimals (and the same thousands grouping and sign) as before. The
convention and its parser are tests/test_readme_figures.py's
(loaded from there: the test owns them); the prose around the figures is yours to re-read.
--check: change nothing, exit 1 when a figure is out of date.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _convention():
    path = next(iter(sorted((ROOT / "tests").glob("**/test_readme_figures.py"))), None)
    if path is None:
        raise SystemExit("no tests/**/test_readme_figures.py: the convention lives there")
    spec = importlib.util.spec_from_file_location("readme_figures", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _format(value: float, like: str) -> str:
    """value written like ``like`` (its decimals, its thousands separator)."""
    sep = next((c for c in like if c in " \u2009\u202f\u00a0,"), None)
    decimals = len(like.split(".")[1]) if "." in like else 0
    text = f"{abs(value):,.{decimals}f}"
    text = text.replace(",", sep) if sep else text.replace(",", "")
    if value < 0 and float(text.replace(sep or ",", "").replace(",", "")) != 0:
        return ("−" if "−" in like or not like.startswith("-") else "-") + text
    return ("+" if like.startswith(("+", "−", "-")) else "") + text  # a signed figure keeps its sign


def refresh(readme: str, conv) -> tuple[str, int]:
    """(the text with every sourced figure rewritten from its source, how many changed)."""
    out, changed, pos = [], 0, 0
    for m in conv.figure_matches(readme):
        if m.group("ref") is None:
            continue
        unit = "×" if m.group("ratio") else m.group("unit")
        value, _ = conv.source_value(m.group("ref").strip(), conv.RESULTS)
        new = _format(value / conv.UNITS[unit][1], m.group("num"))
        if new != m.group("num"):
            changed += 1
        out.append(readme[pos:m.start("num")] + new)
        pos = m.end("num")
    out.append(readme[pos:])
    return "".join(out), changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report only; exit 1 when a figure is stale")
    ap.add_argument("pages", nargs="*", help="pages to refresh (default: every page the test checks)")
    a = ap.parse_args(argv)
    conv = _convention()
    stale = 0
    for name in a.pages or conv.doc_names(ROOT):
        path = ROOT / name
        new, changed = refresh(path.read_text(), conv)
        stale += changed
        if changed:
            print(f"{name}: {changed} figure(s) {'out of date' if a.check else 'rewritten'}", file=sys.stderr)
        if changed and not a.check:
            path.write_text(new)
    print(f"{stale} figure(s) {'out of date' if a.check else 'rewritten'} in all", file=sys.stderr)
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
