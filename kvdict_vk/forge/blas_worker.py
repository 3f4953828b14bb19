"""A learning worker process with OpenBLAS on a chosen kernel set (forge.parallel).

    python -m kvdict_vk.forge.blas_worker < tasks.pickle > results.pickle

Reads one pickle from stdin — (module, function name, [(index, args), ...]) — runs
module.function(*args) for each with BLAS at one thread, and writes one pickle to stdout:
[(index, result), ...], or ("error", exception) when one raised. Started by
forge.parallel with OPENBLAS_CORETYPE in its environment: OpenBLAS reads it when it loads,
which is why this is a fresh interpreter and not a forked or multiprocessing-spawned one
(spawn would re-run the caller's main script).
"""
from __future__ import annotations

import importlib
import pickle
import sys


def main() -> int:
    module, name, items = pickle.load(sys.stdin.buffer)
    from . import parallel
    parallel.limit_blas_threads(1)
    fn = getattr(importlib.import_module(module), name)
    try:
        out = [(i, fn(*args)) for i, args in items]
    except Exception as e:  # travels back and is raised in the parent
        pickle.dump(("error", e), sys.stdout.buffer)
        return 0
    pickle.dump(out, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
