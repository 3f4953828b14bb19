"""Every speed figure the docs quote comes from a committed results file.

The convention (write docs/BENCHMARKS.md and README.md's headline table to it):

* **The speed sections** are the whole of ``docs/BENCHMARKS.md`` and, in README.md and any
  other page (``docs/*.md``, ``lab/*.md``), each section from a line starting with
  ``## Speed`` or ``## At a glance`` to the next ``## `` heading. BENCHMARKS.md and README.md
  must have one. Every figure in a speed section needs a source; outside them, a figure that
  carries a source comment is checked all the same. Fenced code blocks are not checked.
* **A figure** is a number followed by a unit of time (``ns``, ``µs``/``us``, ``ms``, ``s``),
  bandwidth (``B/s``, ``KB/s``, ``MB/s``, ``GB/s``, ``TB/s``, ``KiB/s``, ``MiB/s``,
  ``GiB/s``), rate (``vec/s``, ``tok/s``), a ratio (``×`` written right after the
  number: ``0.87×``; ``3 × 3`` is not a figure) or a percentage (``%``). Thousands may be
  grouped with spaces, thin spaces or commas (``23 300 vec/s``). Each figure carries its
  own unit: write ``84.2 ms / 29.8 ms``, not ``84.2 / 29.8 ms``.
* **Every figure is followed by its source**: right after the unit (closing ``**``, ``*``,
  ``_`` or a backtick may come between) an HTML comment — invisible once rendered —
  ``<!-- DEVICE PATH -->`` or ``<!-- DEVICE PATH / PATH -->`` (a ratio of two values of
  the same file). DEVICE names ``docs/results/DEVICE/summary.json`` — or, written as
  ``NAME.json`` or ``DEVICE/NAME.json``, the committed file ``docs/results/NAME.json``
  (``fidelity.json``, ``arena.json``) or ``docs/results/DEVICE/NAME.json`` (a benchmark's own
  JSON: ``h100/decode_step.json``); PATH is dotted keys into it, ``[i]`` a list index,
  ``rows[BENCHMARK/CASE]`` the row with that benchmark and case (kvdict_vk.bench.results:
  (benchmark, case) is unique) and ``[KEY=VALUE]`` the one list item whose KEY is VALUE::

      59.2 ms<!-- lavapipe rows[attention/dict k4v3 3x3 d64 n4096].gpu_s -->
      **0.87×**<!-- h200 rows[attention/dict k4v3 8x4 d128 n131072].vs_torch_sdpa -->
      24.1 µs<!-- h200 fixed_costs_us.submit_roundtrip -->
      31.5 µs<!-- h200 anchors.cuda_tiny_kernel_sync_us -->
      3.97 TB/s<!-- h200 roofline.bytes_per_s -->
      1.19×<!-- lavapipe rows[attention/dict k4v3 3x3 d64 n4096].gpu_s / rows[attention/f16 3x3 d64 n4096].gpu_s -->
      −0.08 %<!-- fidelity.json texts.sedfaq.rows[name=q8_0].dppl -->

* **Units of the JSON** come from the key names: the last key in PATH with a unit suffix
  — ``…bytes_per_s`` bytes/s, ``…_per_s`` per second, ``…_us`` µs, ``…_ms`` ms, ``…_s``
  seconds (so ``fixed_costs_us.submit_roundtrip`` is µs) — or, with none, a plain number,
  which ``×`` quotes as is and ``%`` as ×100. A ratio of two paths is a plain number when
  both have the same unit. A figure whose unit does not fit its value's fails.
* **Precision**: the figure must be the value rounded to the figure's last written digit
  (``59.2 ms`` is 59.15 … 59.25 ms); for a whole number, to its last non-zero digit
  (``23 300 vec/s`` is 23 250 … 23 350; write ``10.0×`` when ``10×`` is too loose).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # tests/ or tests/<group>/
RESULTS = ROOT / "docs" / "results"

# unit → (dimension, factor to the dimension's base: seconds, bytes/s, 1/s, plain)
UNITS = {"ns": ("s", 1e-9), "µs": ("s", 1e-6), "us": ("s", 1e-6), "ms": ("s", 1e-3), "s": ("s", 1.0),
         "B/s": ("B/s", 1.0), "KB/s": ("B/s", 1e3), "kB/s": ("B/s", 1e3), "MB/s": ("B/s", 1e6),
         "GB/s": ("B/s", 1e9), "TB/s": ("B/s", 1e12), "KiB/s": ("B/s", 2.0 ** 10), "MiB/s": ("B/s", 2.0 ** 20),
         "GiB/s": ("B/s", 2.0 ** 30), "vec/s": ("1/s", 1.0), "tok/s": ("1/s", 1.0), "×": ("", 1.0),
         "%": ("", 0.01)}
KEY_SUFFIXES = (("bytes_per_s", "B/s", 1.0), ("_per_s", "1/s", 1.0), ("_us", "s", 1e-6), ("_ms", "s", 1e-3),
                ("_s", "s", 1.0))
_SEP = "[ \u2009\u202f\u00a0,]"
_PLAIN = rf"[+\-−]?(?:\d{{1,3}}(?:{_SEP}\d{{3}})+|\d+)(?:\.\d+)?"
_NUMBER = rf"(?P<num>{_PLAIN})"
_UNIT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True) if u != "×")
FIGURE = re.compile(rf"(?<![\w.]){_NUMBER}(?:(?P<ratio>×)|[ \u2009\u202f\u00a0]?(?P<unit>{_UNIT})(?![\w/]))"
                    r"(?P<markup>[*_`]*)(?:<!--(?P<ref>.*?)-->)?", re.S)
SHARED_UNIT = re.compile(rf"(?<![\w.]){_PLAIN}\s*/\s*{_PLAIN}[ \u2009\u202f\u00a0]?(?:{_UNIT}|×)(?![\w/])")
COMMENT = re.compile(r"<!--.*?-->", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


@dataclass
class Figure:
    text: str
    value: float  # as written, in its unit
    tolerance: float
    unit: str
    ref: str | None


# the pages whose figures are checked, and which of them must have a speed section
DOC_GLOBS = ("README.md", "docs/*.md", "lab/*.md")
WHOLE = ("docs/BENCHMARKS.md",)  # the whole page is a speed section
NEEDS_SECTION = ("README.md", "docs/BENCHMARKS.md")
SECTION_HEADINGS = ("## Speed", "## At a glance")


def doc_names(root: Path = ROOT) -> list[str]:
    return sorted({p.relative_to(root).as_posix() for g in DOC_GLOBS for p in root.glob(g)})


def speed_sections(text: str, name: str = "README.md") -> list[tuple[int, int]]:
    """(start, end) of each speed section of the page ``name``."""
    if name in WHOLE:
        return [(0, len(text))]
    heads = "|".join(re.escape(h) for h in SECTION_HEADINGS)
    return [m.span() for m in re.finditer(rf"^(?:{heads}).*?(?=^## |\Z)", text, re.S | re.M)]


def speed_section(readme: str) -> str | None:
    """The first speed section of a README-like page (None without one)."""
    spans = speed_sections(readme)
    return readme[spans[0][0]:spans[0][1]] if spans else None


def _number(text: str) -> tuple[float, float]:
    """(value, half a unit of its last significant digit) of a written number."""
    s = re.sub(_SEP, "", text).replace("−", "-")
    if "." in s:
        return float(s), 0.5 * 10.0 ** -len(s.split(".")[1])
    digits = s.lstrip("+-")
    zeros = len(digits) - len(digits.rstrip("0")) if digits.strip("0") else 0
    return float(s), 0.5 * 10.0 ** zeros


def figure_matches(text: str):
    """The FIGURE matches of a text that are not inside comments or fenced code."""
    hidden = [m.span() for m in COMMENT.finditer(text)] + [m.span() for m in FENCE.finditer(text)]
    return [m for m in FIGURE.finditer(text) if not any(a <= m.start() < b for a, b in hidden)]


def figures(section: str) -> list[Figure]:
    """The figures of a speed section (not those inside comments or fenced code)."""
    found = []
    for m in figure_matches(section):
        value, tol = _number(m.group("num"))
        ref = m.group("ref")
        found.append(Figure(m.group(0) if ref is None else m.group(0).split("<!--")[0], value, tol,
                            "×" if m.group("ratio") else m.group("unit"), None if ref is None else ref.strip()))
    return found


def _segments(path: str) -> list[str]:
    """Dotted keys, each with an optional [...] selector; dots inside brackets are kept."""
    out, depth, cur = [], 0, ""
    for ch in path:
        if ch == "." and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    return out + [cur]


def resolve(doc, path: str):
    """(value, key names along the path) of PATH in a summary.json document."""
    node, keys = doc, []
    for seg in _segments(path.strip()):
        m = re.fullmatch(r"([^\[\]]+)(?:\[(.+)\])?", seg)
        if not m:
            raise KeyError(f"bad path segment {seg!r}")
        key, sel = m.groups()
        node = node[key]
        keys.append(key)
        if sel is None:
            continue
        if sel.isdigit():
            node = node[int(sel)]
        elif "=" in sel:
            k, _, want = sel.partition("=")
            hits = [r for r in node if isinstance(r, dict) and str(r.get(k.strip())) == want.strip()]
            if len(hits) != 1:
                raise KeyError(f"{len(hits)} items with {sel!r}")
            node = hits[0]
        elif key == "rows" and "/" in sel:
            bench, case = sel.split("/", 1)
            hits = [r for r in node if r.get("benchmark") == bench and r.get("case") == case]
            if len(hits) != 1:
                raise KeyError(f"{len(hits)} rows named {sel!r}")
            node = hits[0]
        else:
            raise KeyError(f"bad selector [{sel}]")
    return node, keys


def _key_unit(keys: list[str]) -> tuple[str, float]:
    for key in reversed(keys):
        for suffix, dim, factor in KEY_SUFFIXES:
            if key.endswith(suffix):
                return dim, factor
    return "", 1.0


def source_value(ref: str, results: Path) -> tuple[float, str]:
    """(value in its dimension's base unit, dimension) of a reference ``DEVICE PATH[ / PATH]``."""
    device, _, paths = ref.partition(" ")
    summary = results / device if device.endswith(".json") else results / device / "summary.json"
    nested = device.count("/") == 1 and device.endswith(".json")  # DEVICE/NAME.json
    if not device or ("/" in device and not nested) or ".." in device or not summary.is_file():
        raise KeyError(f"no {device or '<device>'}{'' if device.endswith('.json') else '/summary.json'} in {results}")
    doc = json.loads(summary.read_text())
    parts = [p.strip() for p in paths.split(" / ")]
    if not parts[0] or len(parts) > 2:
        raise KeyError(f"reference {ref!r} is not 'DEVICE PATH' or 'DEVICE PATH / PATH'")
    values = []
    for p in parts:
        v, keys = resolve(doc, p)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise KeyError(f"{device} {p} is {v!r}, not a number")
        dim, factor = _key_unit(keys)
        values.append((v * factor, dim))
    if len(values) == 1:
        return values[0]
    (a, da), (b, db) = values
    if da != db:
        raise KeyError(f"a ratio of {da or 'a plain number'} over {db or 'a plain number'}")
    return a / b, ""


def _check(f: Figure, results: Path) -> str | None:
    where = f"{f.text.strip()!r}"
    if f.ref is None:
        return f"{where}: no <!-- DEVICE PATH --> source after it"
    try:
        value, dim = source_value(f.ref, results)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        return f"{where} <!-- {f.ref} -->: {e}"
    want_dim, factor = UNITS[f.unit]
    if dim != want_dim:
        return f"{where}: quoted in {f.unit}, but {f.ref} is {dim or 'a plain number'}"
    quoted = value / factor
    if abs(quoted - f.value) > f.tolerance * (1 + 1e-9):
        return f"{where}: {f.ref} is {quoted:.6g} {f.unit}"
    return None


def problems(readme: str, results: Path, name: str = "README.md") -> list[str]:
    """What is wrong with the figures of the page ``name`` (text ``readme``) against ``results``:
    every figure of its speed sections needs a source that holds it; elsewhere, a figure that
    names a source must match it."""
    spans = speed_sections(readme, name)
    if not spans and name in NEEDS_SECTION:
        return [f"{name} has no '## Speed' section"]
    out = []
    for a, b in spans:
        out += [f"{m.group(0)!r}…: give each figure its own unit" for m in SHARED_UNIT.finditer(readme[a:b])]
    found = [(m.start(), f) for m, f in zip(figure_matches(readme), figures(readme))]
    for pos, f in found:
        inside = any(a <= pos < b for a, b in spans)
        if f.ref is None and not inside:
            continue
        msg = _check(f, results)
        if msg:
            out.append(msg)
    return out


# --- the README itself -------------------------------------------------------------------------

def test_readme_speed_figures_come_from_committed_results():
    readme = (ROOT / "README.md").read_text()
    found = problems(readme, RESULTS)
    assert not found, "README.md's speed figures (tests/test_readme_figures.py has the convention):\n" \
        + "\n".join(found)
    assert figures(speed_section(readme)), "README.md's headline quotes no figure"


@pytest.mark.parametrize("name", NEEDS_SECTION)
def test_pages_that_must_quote_figures_exist(name):
    assert (ROOT / name).is_file(), name


@pytest.mark.parametrize("name", doc_names())
def test_doc_figures_come_from_committed_results(name):
    text = (ROOT / name).read_text()
    found = problems(text, RESULTS, name)
    assert not found, f"{name}'s figures (tests/test_readme_figures.py has the convention):\n" + "\n".join(found)
    if name in WHOLE:
        assert figures(text), f"{name} quotes no figure"


def test_committed_results_have_the_schema():
    from kvdict_vk.bench import attention
    from kvdict_vk.bench.results import CACHES, REQUIRED
    files = sorted(RESULTS.glob("*/summary.json"))
    assert files, "no docs/results/<device>/summary.json committed"
    for path in files:
        s = json.loads(path.read_text())
        for key in ("device", "driver", "command", "when", "roofline", "fixed_costs_us", "rows"):
            assert key in s, f"{path}: no {key}"
        assert s["roofline"]["bytes_per_s"] > 0 and s["roofline"]["bytes"] > 0, path
        if "fixed" in s.get("benchmarks", {}) and "failed" in s["benchmarks"]["fixed"]:
            assert s["fixed_costs_us"] is None, path  # a run of some benchmarks only (docs/results/h100)
        else:
            assert s["fixed_costs_us"]["submit_roundtrip"] > 0, path
        assert s["rows"], f"{path}: no rows"
        for r in s["rows"]:
            assert all(k in r for k in REQUIRED), (path, r.get("case"))
            assert r["cache"] in CACHES, (path, r["case"])
        # every cache the attention bench knows; the KIVI cache joined it after the committed
        # runs, so it is required once a run has it (the next bench run on each device)
        caches = {r["cache"] for r in s["rows"] if r["benchmark"] == "attention"}
        required = {*attention.UNCODED, "dict"} | ({attention.KIVI} & caches)
        assert caches == required, path


# --- the checker, on made-up READMEs -----------------------------------------------------------

@pytest.fixture
def results(tmp_path):
    summary = {"roofline": {"bytes_per_s": 3.97e12, "bytes": 1 << 30},
               "fixed_costs_us": {"submit_roundtrip": 24.14},
               "rows": [{"benchmark": "attention", "case": "f16 3x3 d64 n4096", "gpu_s": 0.0592, "wall_s": 0.061,
                         "vectors_per_s": 23317.0, "vs_torch_sdpa": 0.871, "roofline_fraction": 0.4267},
                        {"benchmark": "attention", "case": "dict k4v3 3x3 d64 n4096", "gpu_s": 0.0704}]}
    (tmp_path / "gpu0").mkdir()
    (tmp_path / "gpu0" / "summary.json").write_text(json.dumps(summary))
    rows = [{"name": "q8_0", "dppl": -0.00031}, {"name": "dict, K 4+6 b", "dppl": 0.0028}]
    fidelity = {"texts": {"gpl3": {"rows": rows}}}
    (tmp_path / "fidelity.json").write_text(json.dumps(fidelity))
    return tmp_path


def _readme(body: str) -> str:
    return f"# x\n\nintro 5 ms\n\n## Speed — measured\n\n{body}\n\n## Next\n\n9 ms unchecked\n"


F16 = "rows[attention/f16 3x3 d64 n4096]"
DICT = "rows[attention/dict k4v3 3x3 d64 n4096]"


@pytest.mark.parametrize("body", [
    f"| f16 | 59.2 ms<!-- gpu0 {F16}.gpu_s --> |",
    f"**59.2 ms**<!-- gpu0 {F16}.gpu_s -->",
    f"59 200 µs<!-- gpu0 {F16}.gpu_s -->",
    f"24.1 µs<!-- gpu0 fixed_costs_us.submit_roundtrip --> and 0.0241 ms<!-- gpu0 fixed_costs_us.submit_roundtrip -->",
    f"3.97 TB/s<!-- gpu0 roofline.bytes_per_s -->, 3 970 GB/s<!-- gpu0 roofline.bytes_per_s -->",
    f"23 300 vec/s<!-- gpu0 {F16}.vectors_per_s -->",
    f"0.87×<!-- gpu0 {F16}.vs_torch_sdpa --> and 42.7 %<!-- gpu0 {F16}.roofline_fraction -->",
    f"1.19×<!-- gpu0 {DICT}.gpu_s / {F16}.gpu_s -->",
    "8 KV heads × GQA 4, 3 × 3, head_dim 64, s 8, 1024 atoms, n_used 8192",  # no figures at all
    "```\nkvdict-bench  # 42 ms here is code\n```",
    "−0.03 %<!-- fidelity.json texts.gpl3.rows[name=q8_0].dppl -->,"
    " +0.28 %<!-- fidelity.json texts.gpl3.rows[name=dict, K 4+6 b].dppl -->",
])
def test_checker_accepts_sourced_figures(body, results):
    assert problems(_readme(body), results) == []


@pytest.mark.parametrize("body, complaint", [
    ("59.2 ms", "no <!-- DEVICE PATH --> source"),
    (f"59.3 ms<!-- gpu0 {F16}.gpu_s -->", "is 59.2 ms"),
    (f"23 400 vec/s<!-- gpu0 {F16}.vectors_per_s -->", "is 23317"),
    (f"59.2 ms<!-- nosuch {F16}.gpu_s -->", "no nosuch/summary.json"),
    (f"59.2 ms<!-- gpu0 rows[attention/f16 1x1 d64 n1].gpu_s -->", "0 rows named"),
    (f"59.2 GB/s<!-- gpu0 {F16}.gpu_s -->", "quoted in GB/s, but"),
    (f"0.87 ms<!-- gpu0 {F16}.vs_torch_sdpa -->", "a plain number"),
    (f"1.2×<!-- gpu0 {DICT}.gpu_s / roofline.bytes_per_s -->", "a ratio of s over B/s"),
    (f"84.2 / 59.2 ms<!-- gpu0 {F16}.gpu_s -->", "give each figure its own unit"),
    ("+0.28 %<!-- fidelity.json texts.gpl3.rows[name=q8_0].dppl -->", "is -0.031 %"),
    ("1 %<!-- fidelity.json texts.gpl3.rows[name=f16].dppl -->", "0 items with"),
    ("1 %<!-- nosuch.json texts -->", "no nosuch.json in"),
])
def test_checker_rejects(body, complaint, results):
    found = problems(_readme(body), results)
    assert found and complaint in "\n".join(found), found


def test_checker_needs_a_speed_section(results):
    assert problems("# x\n\n59.2 ms\n", results) == ["README.md has no '## Speed' section"]


def test_a_whole_page_is_a_speed_section(results):
    page = f"# Benchmarks\n\n## Attention\n\n59.2 ms<!-- gpu0 {F16}.gpu_s -->\n\n## Encode\n\n5 ms\n"
    assert problems(page, results, "docs/BENCHMARKS.md") == ["'5 ms': no <!-- DEVICE PATH --> source after it"]
    assert problems("# B\n", results, "docs/BENCHMARKS.md") == []  # no figures: the real page's test says so


def test_sourced_figures_are_checked_anywhere(results):
    page = f"# Notes\n\n59.3 ms<!-- gpu0 {F16}.gpu_s --> and 7 ms unsourced\n"
    found = problems(page, results, "lab/NOTEBOOK.md")
    assert len(found) == 1 and "is 59.2 ms" in found[0], found


def test_figures_outside_the_speed_section_are_not_read(results):
    readme = _readme(f"59.2 ms<!-- gpu0 {F16}.gpu_s -->")
    assert [f.text for f in figures(speed_section(readme))] == ["59.2 ms"]
