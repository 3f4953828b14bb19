"""Test harness: one Vulkan device probe per session, and the validation layer as a gate.

* Before anything can create a Vulkan instance (this file is imported before the test
  modules), ``VK_INSTANCE_LAYERS`` gets ``VK_LAYER_KHRONOS_validation`` and
  ``VK_LAYER_SETTINGS_PATH`` points at a temp dir whose ``vk_layer_settings.txt`` sends
  every error/warning/performance message to ``validation.log`` there.
* Tests marked ``gpu`` need the session probe; without a device they FAIL when ``CI`` or
  ``KVDICT_REQUIRE_DEVICE`` is set (``make test`` sets the latter: never skip green) and
  skip otherwise. In that mode a missing validation layer fails the run too.
* After every gpu test, anything new in the log fails that test; at session end a
  non-empty log fails the run.

The layer opens its log with mode "w" for every VkInstance, so a second instance
truncates what the first wrote: the probe reads the log after the loader query
(``list_devices``, a short-lived instance) and before Kompute's instance, which then
lives for the whole session. ``KVDICT_NO_VALIDATION=1`` turns the gate off.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

LAYER = "VK_LAYER_KHRONOS_validation"
_LAYER_JSON = "VkLayer_khronos_validation.json"
_VVL_DIR = Path(tempfile.mkdtemp(prefix="kvdict-vvl-"))
VALIDATION_LOG = _VVL_DIR / "validation.log"


def validation_layer_installed() -> bool:
    dirs = [p for p in os.environ.get("VK_LAYER_PATH", "").split(os.pathsep) if p]
    data = os.environ.get("XDG_DATA_DIRS", "/usr/local/share:/usr/share").split(os.pathsep)
    dirs += [os.path.join(d, "vulkan", "explicit_layer.d") for d in data + ["/etc"]]
    return any(os.path.isfile(os.path.join(d, _LAYER_JSON)) for d in dirs)


def layer_settings(log: Path, *, sync: bool = True) -> str:
    """The validation layer's settings: every message to ``log``; ``sync``: also
    synchronization validation (off only for the soak: see tests/test_vk_soak.py)."""
    text = ("khronos_validation.debug_action = VK_DBG_LAYER_ACTION_LOG_MSG\n"
            f"khronos_validation.log_filename = {log}\n"
            "khronos_validation.report_flags = error,warn,perf\n")
    # synchronization validation: hazards between dispatches and copies (kernels.barrier
    # records the barriers; this checks them)
    sync_line = "khronos_validation.enables = VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT\n"
    return text + (sync_line if sync else "")


def device_required() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("KVDICT_REQUIRE_DEVICE"))


def _configure_validation() -> bool:
    if os.environ.get("KVDICT_NO_VALIDATION"):
        return False
    if not validation_layer_installed():
        if device_required():
            raise RuntimeError(f"{LAYER} is not installed; the GPU suite must run under it")
        return False
    (_VVL_DIR / "vk_layer_settings.txt").write_text(layer_settings(VALIDATION_LOG))
    os.environ["VK_LAYER_SETTINGS_PATH"] = str(_VVL_DIR)
    layers = [l for l in os.environ.get("VK_INSTANCE_LAYERS", "").split(":") if l]
    if LAYER not in layers:
        os.environ["VK_INSTANCE_LAYERS"] = ":".join(layers + [LAYER])
    return True


VALIDATION = _configure_validation()


class _Log:
    """Incremental reader of the validation log (copes with truncation by a new instance)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.seen = path, 0, []

    def new_text(self, *, expected: bool = False) -> str:
        """What the layer wrote since the last call; ``expected`` messages (a test that
        provokes one on purpose) are not held against the session."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return ""
        if len(data) < self.offset:
            self.offset = 0
        text = data[self.offset:].replace(b"\0", b"").decode(errors="replace")
        self.offset = len(data)
        if text.strip() and not expected:
            self.seen.append(text)
        return text


LOG = _Log(VALIDATION_LOG)


@dataclass
class Probe:
    device: object  # kvdict_vk.vk.device.Device or None
    error: str | None
    early_messages: str  # what the layer said about the loader query


@pytest.fixture(scope="session")
def vk_probe() -> Probe:
    try:
        from kvdict_vk.vk import device
        device.list_devices()
        early = LOG.new_text()
        dev = device.get_device()
        dev.manager  # Kompute's instance: lives for the session
        return Probe(dev, None, early)
    except Exception as e:  # the probe reports, the gate decides (fail in CI, skip locally)
        return Probe(None, f"{type(e).__name__}: {e}", LOG.new_text())


@pytest.fixture(autouse=True)
def _no_choice_store(monkeypatch):
    """Measured choices stay in the test's process: a store named in the environment
    (kvdict_vk.vk.choice_store.CACHE_ENV) would answer the tests that count measurements."""
    from kvdict_vk.vk import choice_store
    monkeypatch.delenv(choice_store.CACHE_ENV, raising=False)


@pytest.fixture(autouse=True)
def _gpu_gate(request):
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    probe = request.getfixturevalue("vk_probe")
    if probe.device is None:
        msg = f"no usable Vulkan device: {probe.error}"
        if device_required():
            pytest.fail(msg)
        pytest.skip(msg)
    if probe.early_messages.strip():
        pytest.fail(f"validation layer reported during the device query:\n{probe.early_messages}")
    LOG.new_text()  # only this test's messages count below
    yield
    text = LOG.new_text()
    if text.strip():
        pytest.fail(f"Vulkan validation layer reported:\n{text[:6000]}", pytrace=False)


@pytest.fixture
def vk_device(vk_probe):
    return vk_probe.device


def pytest_report_header(config):
    """The validation layer's state, then kvdict_vk.diagnostics' summary: versions (kp and its
    patch), the devices (``*``: the one the session uses), artifact, tuner cache, SPIR-V. The
    device query is list_devices' cached one, which the session's probe then reuses (so the
    probe still reads what the layer said about it)."""
    state = f"validation layer → {VALIDATION_LOG}" if VALIDATION else "validation layer OFF"
    lines = [f"kvdict_vk: {state}"]
    try:
        from kvdict_vk import diagnostics
        lines += [f"kvdict_vk: {line}" for line in diagnostics.summary_lines()]
    except Exception as e:  # the header never stops a session: the probe reports the device
        lines.append(f"kvdict_vk: diagnostics unavailable ({type(e).__name__}: {e})")
    return lines


def pytest_sessionfinish(session, exitstatus):
    if not VALIDATION:
        return
    LOG.new_text()
    if not LOG.seen:
        import shutil
        shutil.rmtree(_VVL_DIR, ignore_errors=True)  # nothing to inspect
    else:
        print(f"\nVulkan validation layer messages ({VALIDATION_LOG}):\n" + "".join(LOG.seen)[:6000])
        session.exitstatus = 1


# --- shared helpers for the gpu tests ---------------------------------------------------------

def stable_seed(case) -> int:
    """A seed from a test case's repr: the same in every process (``hash`` of a tuple that
    holds None or a str changes between processes)."""
    import zlib
    return zlib.crc32(repr(case).encode())


def stream_entry(e):
    """A ``streams`` entry: None (passthrough), s, or (s, residual_bits)."""
    return (None, 0) if e is None else (e if isinstance(e, tuple) else (e, 0))


# encode_choice._measure's answer (seconds by part) where the GPU encoder is the faster: tests
# that fake the measurement return it
GPU_FASTER = {"cpu_s": 2e-3, "gpu_s": 1e-3, "gpu_first_s": 5e-3}


def random_artifact(rng, head_dim: int, n_atoms: int, streams, *, means=True, n_heads: int = 1,
                    f16_atoms: bool = False):
    """A KvDictArtifact with random atoms; ``streams`` per layer a (K, V) pair of entries:
    None = passthrough, s = sparsity, or (s, residual_bits). ``n_heads`` dictionary heads
    per stream (1 = shared, else one per KV head). Means on every other coded stream when
    ``means``; residual scales in [0.5, 1.5). ``f16_atoms``: atoms rounded to binary16
    values, as the forge rounds them (the arena then keeps them in binary16)."""
    import numpy as np
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict, round_to_f16
    layers, count = [], 0
    for pair in streams:
        out = []
        for e in pair:
            s, bits = stream_entry(e)
            if s is None:
                out.append(None)
                continue
            atoms = rng.standard_normal((n_heads, n_atoms, head_dim), dtype=np.float32)
            atoms = round_to_f16(atoms) if f16_atoms else atoms
            mean = (rng.standard_normal((n_heads, head_dim), dtype=np.float32)
                    if means and count % 2 == 0 else None)
            scale = (rng.random((n_heads, head_dim), dtype=np.float32) + 0.5) if bits else None
            out.append(StreamDict(atoms, mean=mean, sparsity=s, residual_bits=bits, residual_scale=scale))
            count += 1
        layers.append(tuple(out))
    s_max = max([stream_entry(e)[0] for p in streams for e in p if e is not None] or [1])
    return KvDictArtifact(head_dim, n_atoms, s_max, tuple(layers))


def check_guards(arena) -> None:
    """Every word outside every region/tail block still holds the sentinel."""
    breaches = arena.layout.guard_breaches(arena.layer_words)
    assert not breaches, "; ".join(f"layer {layer}: guard words [{lo}, {hi}) overwritten at {where}"
                                   for layer, lo, hi, where in breaches)


@pytest.fixture
def restore_env(monkeypatch):
    """The benchmarks disable the validation layer through the environment (for Vulkan
    instances made later): undo it after the test, the session's layer gate relies on it."""
    monkeypatch.setenv("VK_LOADER_LAYERS_DISABLE", "")


@pytest.fixture
def activate():
    """activate(artifact): make the test's (uncertified, random) artifact the runtime's
    active dictionary; the state before is restored afterwards."""
    from kvdict_vk import runtime
    prev = runtime.snapshot()
    yield lambda artifact: runtime.enable(artifact, allow_uncertified=True)
    runtime.restore(prev)


@pytest.fixture
def make_arena(vk_device):
    """make_arena(n_layers, n_kv, head_dim, n_ctx, guard_words=64): a guarded arena whose
    guards are verified, and which is freed, after the test. Its appends encode with the CPU
    codec — what the tests compare against — unless the test (or $KVDICT_VK_ENCODER) names
    an encoder: "auto" would pick the GPU encoder on some GPUs, whose ties may differ."""
    from kvdict_vk.vk import KvArena
    from kvdict_vk.vk.arena.config import ENCODER_ENV
    made = []

    def _make(*dims, guard_words: int = 64, **kw):
        if "encoder" not in kw and not os.environ.get(ENCODER_ENV):
            kw["encoder"] = "cpu"
        a = KvArena(*dims, device=vk_device, guard_words=guard_words, **kw)
        made.append(a)
        return a
    yield _make
    for a in made:
        if not a.closed:
            check_guards(a)
            a.free()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (or with KVDICT_REQUIRE_DEVICE) nothing may skip itself green: a skip — a
    missing optional package, device or layer — is reported as a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and device_required() and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped, which CI does not allow: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (pytest.importorskip at top level)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and device_required():
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped, which CI does not allow: {reason}"
