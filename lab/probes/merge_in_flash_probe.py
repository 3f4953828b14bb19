"""attend_flash merging its own splits (MERGE_LAST) against attend_merge_head after it, in one
process: the attention benchmark run twice with the same arguments, kvdict_vk.vk.attend.ops'
MERGE_IN_FLASH False then True, each writing its own results file.

    python lab/probes/merge_in_flash_probe.py --out-dir lab/results/<device>/merge_in_flash -- <kvdict_vk.bench.attention args>
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    a = ap.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    from kvdict_vk.bench import attention
    from kvdict_vk.vk.attend import ops
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for merge_in_flash in (False, True):
        ops.MERGE_IN_FLASH = merge_in_flash
        name = "merge_in_flash" if merge_in_flash else "merge_pass"
        print(f"--- MERGE_IN_FLASH {merge_in_flash}", flush=True)
        attention.main([*bench_args, "--out", str(a.out_dir / f"{name}.json")])


if __name__ == "__main__":
    main()
