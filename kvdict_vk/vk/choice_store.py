"""Measured choices kept across processes: a JSON file named by $KVDICT_VK_TUNE_CACHE.

Two things are chosen here by timing on the device, once per process and key: the flash
kernels' launch shape (attend_tune) and which encoder writes a coded stream (encode_choice).
With the variable set, each choice is also written to the file — under its chooser's kind and
key, with the candidates it was chosen among — and a later process takes it from there instead
of timing again. Keys carry what the timing depended on (device_identity: device, driver and
the SPIR-V timed; the encoder's also the host CPU), so anything else measures anew. Writes take
an exclusive flock, read the file, add and rewrite: processes sharing a file keep each other's
choices. A damaged file (not JSON, not UTF-8, another version, a choice outside its candidates)
is measured around and rewritten; one that cannot be written is logged, never raised.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

try:
    import fcntl  # the lock (POSIX); without it, concurrent writers may drop a choice
except ImportError:  # pragma: no cover
    fcntl = None

from . import spirv

LOG = logging.getLogger(__name__)
CACHE_ENV = "KVDICT_VK_TUNE_CACHE"  # unset or empty: choices stay in their process
STORE_VERSION = 1


def path() -> Path | None:
    """The file named by $KVDICT_VK_TUNE_CACHE (None: unset or empty, no store)."""
    name = os.environ.get(CACHE_ENV, "")
    return Path(name).expanduser() if name else None


def device_identity(device, variants: tuple) -> tuple:
    """(device name, driver, digest of ``variants``' SPIR-V): what a choice's timing ran on —
    a driver update or a rebuilt shader (``$KVDICT_VK_SPV_DIR`` included) measures anew."""
    info = device.info
    return (device.name, f"{info.driver_name} {info.driver_info} {info.driver_version}".strip(),
            _spirv_digest(tuple(variants), os.environ.get(spirv.SPV_DIR_ENV, "")))


@functools.lru_cache(maxsize=None)
def _spirv_digest(variants: tuple, spv_dir: str) -> str:
    """Read once per override directory (an engine asks once per layer)."""
    digest = hashlib.sha256()
    for variant in variants:
        digest.update(spirv.load(variant))
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    """The host's CPU model and core count (a CPU codec's timing depends on them)."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or 'unknown CPU'} x{os.cpu_count() or 0}"


def _entry_key(kind: str, key: tuple) -> str:
    return json.dumps([kind, *key])  # tuples as lists: keys hold strings, ints, bools and tuples


def _read(f) -> dict:
    """The stored choices of an open file ({} when empty; a file that is not a store of this
    version is logged and read as empty — it is rewritten on the next save)."""
    f.seek(0)
    try:
        text = f.read()
        if not text.strip():
            return {}
        data = json.loads(text)
        if data.get("version") != STORE_VERSION or not isinstance(data.get("choices"), dict):
            raise ValueError(f"not a version-{STORE_VERSION} choice store")
        return data["choices"]
    except (ValueError, AttributeError) as e:
        LOG.warning("%s: %s; measuring again and rewriting it", f.name, e)
        return {}


def load(kind: str, key: tuple, offered: list):
    """The stored choice of ``kind`` for ``key`` if it was made among exactly ``offered``
    (JSON values: lists, strings, numbers) and is one of them; else None."""
    where = path()
    if where is None or not where.is_file():
        return None
    try:
        with open(where, encoding="utf-8") as f:
            entry = _read(f).get(_entry_key(kind, key))
    except OSError as e:
        LOG.warning("%s: unreadable (%s); measuring", where, e)
        return None
    if not isinstance(entry, dict) or entry.get("offered") != offered:
        return None
    choice = entry.get("choice")
    return choice if choice in offered else None  # a choice must be one of its candidates


def save(kind: str, key: tuple, offered: list, choice) -> None:
    """Adds a choice to the store (a no-op without one), under an exclusive lock."""
    where = path()
    if where is None:
        return
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with open(where, "a+", encoding="utf-8") as f:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)
            choices = _read(f)
            choices[_entry_key(kind, key)] = {"offered": offered, "choice": choice}
            f.seek(0)
            f.truncate()
            json.dump({"version": STORE_VERSION, "choices": choices}, f, indent=1, sort_keys=True)
            f.write("\n")
    except OSError as e:
        LOG.warning("%s: cannot store a measured choice (%s)", where, e)
