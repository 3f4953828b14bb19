"""The evaluation texts of the gate: English prose of three domains that a Debian 12 machine
with scripts/setup.sh's packages holds, none of it used for calibration.

* ``gpl3`` — /usr/share/common-licenses/GPL-3 (legal text; package base-files).
* ``sedfaq`` — /usr/share/doc/sed/sedfaq.txt.gz, the sed FAQ (technical question-and-answer
  prose; package sed, which is Essential, so every Debian system has it unless its docs
  were stripped, as "slim" container images do).
* ``cmake`` — CMake's build-system manual, /usr/share/cmake-3.25/Help/manual/cmake-buildsystem.7.rst
  (package cmake-data, which scripts/setup.sh's cmake depends on): the long-context gate's
  third text (LONG_TEXTS), not the default gate's.
* ``pydoc`` — the Python language reference's topics in
  /usr/lib/python3.11/pydoc_data/topics.py (reference-manual prose; package
  libpython3.11-stdlib, which the virtualenv's interpreter needs). The file is a Python
  dict literal: its values, joined in sorted key order, are the text.

Calibration is /usr/share/common-licenses without GPL-3 (pipeline.calibration_files), so
the other two texts are of domains the dictionaries never saw. Each text is identified
in the certificate by the SHA-256 of its UTF-8 text as tokenised and of the file's bytes.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import os
from dataclasses import dataclass

from .. import errors as E

GPL3 = "/usr/share/common-licenses/GPL-3"


@dataclass(frozen=True)
class EvalText:
    name: str
    path: str
    windows: int  # 1024-token windows scored (the first ones of the text)
    domain: str

    def file_bytes(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError as e:
            raise E.KvDictError(f"evaluation text {self.name} missing: {self.path} ({e.strerror}); "
                                f"install its Debian package or pass --texts without it") from e

    def text(self) -> str:
        text = decode_text(self.path, self.file_bytes())
        return _pydoc_topics(text) if self.path.endswith("pydoc_data/topics.py") else text

    def file_sha256(self) -> str:
        return hashlib.sha256(self.file_bytes()).hexdigest()


def decode_text(path: str, raw: bytes) -> str:
    """A text file's bytes as text: gunzipped when the name ends in .gz, UTF-8, line ends as
    they are on disk (the evaluation texts and forge.pipeline's calibration files)."""
    return (gzip.decompress(raw) if path.endswith(".gz") else raw).decode("utf-8")


def _pydoc_topics(source: str) -> str:
    """topics.py is `# comment\\ntopics = {...}`: the dict's values in sorted key order."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "topics":
            topics = ast.literal_eval(node.value)
            return "\n\n".join(topics[k] for k in sorted(topics))
    raise E.KvDictError("pydoc topics: no `topics = {...}` assignment found")


# GPL-3 keeps its 7 full windows (the number every earlier result used); the two new texts
# add 4 windows each — 15 windows, 15 345 scored tokens in all. More windows would narrow
# each text's interval but cost the demo's first run ~15 s per window and configuration.
EVAL_TEXTS = {
    "gpl3": EvalText("gpl3", GPL3, 7, "legal (software license)"),
    "sedfaq": EvalText("sedfaq", "/usr/share/doc/sed/sedfaq.txt.gz", 4, "technical FAQ"),
    "pydoc": EvalText("pydoc", "/usr/lib/python3.11/pydoc_data/topics.py", 4, "language reference manual"),
    "cmake": EvalText("cmake", "/usr/share/cmake-3.25/Help/manual/cmake-buildsystem.7.rst", 12,
                      "build-system manual (reStructuredText)"),
}
DEFAULT_TEXTS = ("gpl3", "sedfaq", "pydoc")
# The long-context gate's (ForgeConfig.eval_window 4 096): texts of at least three 4 096-token
# windows — GPL-3 holds one (7 639 tokens), so cmake's build-system manual (12 467 tokens, package
# cmake-data, which setup.sh's cmake brings) stands beside sedfaq (47 122) and pydoc (112 333).
LONG_TEXTS = ("sedfaq", "pydoc", "cmake")


def get(names) -> list[EvalText]:
    unknown = [n for n in names if n not in EVAL_TEXTS]
    if unknown:
        raise E.KvDictError(f"unknown evaluation text(s) {unknown}; known: {sorted(EVAL_TEXTS)}")
    return [EVAL_TEXTS[n] for n in names]


def eval_paths() -> set[str]:
    """Real paths of every evaluation text (calibration must not read them)."""
    return {os.path.realpath(t.path) for t in EVAL_TEXTS.values()}
