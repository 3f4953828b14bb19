"""Coverage-guided fuzzing of the artifact loader (atheris / libFuzzer).

Every input must end in a valid load or a kvdict_vk.errors.ArtifactError with nothing
installed; anything else (another exception, a crash, a hang, a memory blow-up beyond
-rss_limit_mb) is a finding. The seed corpus is a few valid artifacts and mutations of
their header and payload with the CRC and SHA-256 fixed up, so the fuzzer reaches past
the integrity checks. A custom mutator re-seals the frame (header CRC, payload hash and
length) after libFuzzer's byte mutations half of the time, for the same reason.

    .venv/bin/pip install -e ".[fuzz]"          # atheris and coverage
    .venv/bin/python tools/fuzz_loader.py -atheris_runs=200000 out/fuzz-corpus
    .venv/bin/python tools/fuzz_loader.py --coverage out/fuzz-corpus   # line coverage of the loader
"""
from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
import zlib

import cbor2
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def seeds() -> list[bytes]:
    from helpers import toy_artifact, toy_cert
    from kvdict_vk import artifact as A
    from kvdict_vk.dictionary import KvDictArtifact, StreamDict
    rng = np.random.default_rng(0)
    out = []
    for n_layers, na, hd, s in ((1, 4, 4, 2), (2, 8, 6, 3), (2, 16, 8, 4)):
        art = toy_artifact(rng, n_layers=n_layers, n_atoms=na, head_dim=hd, s=s)
        out.append(A.encode_file(art, toy_cert(art)))
    k = StreamDict(rng.standard_normal((2, 8, 4)), rng.standard_normal((2, 4)), None, 2,
                   residual_bits=3, residual_scale=np.ones((2, 4)))
    art = KvDictArtifact(4, 8, 2, [(k, None)])
    out.append(A.encode_file(art, toy_cert(art, n_kv_heads=2)))
    return out


def reseal(data: bytes) -> bytes:
    """Fix the frame's CRC and the header's payload length/hash for whatever follows."""
    from kvdict_vk import artifact as A
    if len(data) < A.FRAME.size:
        return data
    magic, ver, flags, hlen, _ = A.FRAME.unpack(data[:A.FRAME.size])
    header, payload = data[A.FRAME.size:A.FRAME.size + hlen], data[A.FRAME.size + hlen:]
    try:
        h = cbor2.loads(header)
        h["payload"] = {"length": len(payload), "sha256": hashlib.sha256(payload).digest()}
        header = cbor2.dumps(h)
    except Exception:  # noqa: BLE001 — a header that no longer decodes stays as it is
        pass
    return A.FRAME.pack(magic, ver, flags, len(header), zlib.crc32(header)) + header + payload


_PATH = os.path.join(tempfile.mkdtemp(prefix="kvdict-fuzz-"), "input.q42art")


def one_input(data: bytes) -> None:
    from kvdict_vk import errors as E
    from kvdict_vk import runtime
    with open(_PATH, "wb") as f:
        f.write(data)
    before = runtime.snapshot()
    try:
        runtime.load_certified(_PATH)
    except E.ArtifactError:
        if runtime.snapshot() is not before:
            raise AssertionError("a refused artifact changed the installed state")
        return
    runtime.clear()


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    import atheris
    data = atheris.Mutate(data, max_size)
    return reseal(data) if random.Random(seed).random() < 0.5 else data


def main() -> int:
    if "--coverage" in sys.argv:
        return coverage_report([a for a in sys.argv[1:] if not a.startswith("-")])
    import atheris
    with atheris.instrument_imports():  # before anything imports them uninstrumented
        import kvdict_vk.artifact  # noqa: F401
        import kvdict_vk.dictionary  # noqa: F401
        import kvdict_vk.residual  # noqa: F401
        import kvdict_vk.runtime  # noqa: F401
        import cbor2  # noqa: F401
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    for d in corpus:
        os.makedirs(d, exist_ok=True)
        if not os.listdir(d):
            for i, s in enumerate(seeds()):
                with open(os.path.join(d, f"seed{i}"), "wb") as f:
                    f.write(s)
    argv = sys.argv + ([] if any(a.startswith("-max_len") for a in sys.argv) else ["-max_len=65536"])
    atheris.Setup(argv, one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()
    return 0


def coverage_report(corpus_dirs: list[str]) -> int:
    """Replay a corpus under coverage.py: line coverage of the loader's modules."""
    import coverage
    cov = coverage.Coverage(include=["*/kvdict_vk/artifact.py", "*/kvdict_vk/dictionary.py", "*/kvdict_vk/runtime.py"])
    cov.start()
    n = 0
    for d in corpus_dirs:
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                one_input(f.read())
            n += 1
    cov.stop()
    print(f"replayed {n} inputs")
    cov.report(show_missing=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
