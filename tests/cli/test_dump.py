"""kvdict-dump: totals add up, the layout is the one KvArena allocates, no Vulkan needed,
untrusted names are sanitised, bad input exits non-zero with one line on stderr."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvdict_vk import artifact as A
from kvdict_vk import layout as L
from kvdict_vk import rows as R
from kvdict_vk.cli import dump

from helpers import toy_artifact, toy_cert

NO_KP = "import sys; sys.modules['kp'] = None; from kvdict_vk.cli.dump import main; sys.exit(main(sys.argv[1:]))"


def _dump(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_KP, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", params=["f32-atoms", "f16-atoms", "window", "key-rope"])
def art_path(tmp_path_factory, request):
    """f16-atoms: the atoms rounded to binary16 values, as the forge makes them (the layout
    then keeps them in binary16: half the atoms' words); window: an exact window (its blocks
    and state word in every layer with a coded stream)."""
    import dataclasses

    from kvdict_vk.window import ExactWindow
    rng = np.random.default_rng(4)
    art = toy_artifact(rng, n_layers=3, n_atoms=40, head_dim=16, s=3, passthrough=((1, 1),))
    if request.param == "f16-atoms":
        art = art.with_f16_atoms()
        assert art.atoms_f16_exact
    if request.param == "window":
        art = dataclasses.replace(art, window=ExactWindow(1, 8))
    if request.param == "key-rope":  # keys coded before RoPE: a rotation table in each K-coded layer's tail
        from kvdict_vk.rope import KeyRope
        art = dataclasses.replace(art, key_rope=KeyRope(10000.0, 16))
    cert = toy_cert(art)
    cert = A.CertInfo(**{**cert.__dict__, "producer": {"name": "evil\x1b[31m\nname", "version": "1"}})
    p = tmp_path_factory.mktemp("dump") / "t.q42art"
    A.write_artifact(p, art, cert)
    return p, art


def test_json_totals_add_up_without_kp(art_path):
    p, art = art_path
    out = _dump(p, "--n-ctx", 100, "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    t = d["totals"]
    assert t["region_bytes"] + t["tail_bytes"] + t["padding_bytes"] == t["bytes"]
    assert t["bytes"] == sum(l["total"]["bytes"] for l in d["layers"])
    for l in d["layers"]:
        assert sum(b["bytes"] + 4 * b["padding_words"] for b in l["blocks"]) + 4 * l["blocks"][0]["word"] \
            == l["total"]["bytes"]
    lay = L.build_layout(3, 2, 16, 100, art)
    assert t["bytes"] == lay.total_bytes and t["bytes_per_token"] == lay.bytes_per_token
    assert d["certification"]["passed"] and "\x1b" not in out.stdout and "\n" not in d["certification"]["producer"]
    assert d["layers"][1]["v"]["coded"] is False and d["layers"][0]["k"]["sparsity"] == 3
    names = {b["name"] for b in d["layers"][0]["blocks"]}
    assert ({"k window", "v window", "k state"} <= names) == bool(art.window)
    assert ("k rope_table" in names) == (art.key_rope is not None) and "v rope_table" not in names
    if art.key_rope is not None:  # (⌈100 / 16⌉ + 16) rows of head_dim floats
        assert d["layers"][0]["k"]["rope_table"]["words"] == (7 + 16) * 16


def test_human_table_and_layer_filter(art_path):
    p, _ = art_path
    out = _dump(p, "--n-ctx", 64, "--layer", 1)
    assert out.returncode == 0
    assert "PASSED" in out.stdout and "f32" in out.stdout and "\x1b" not in out.stdout
    rows = [l for l in out.stdout.splitlines() if "region" in l and l.split()[0].isdigit()]
    assert rows and all(r.split()[0] == "1" for r in rows)


def test_uncoded_layouts_from_flags():
    dims = ("--n-layers", 30, "--n-kv-heads", 3, "--head-dim", 64, "--n-ctx", 1024, "--json")
    d = json.loads(_dump(*dims).stdout)
    assert d["mode"] == "f16" and d["totals"]["bytes"] == 30 * 2 * 3 * 1024 * 64 * 2
    assert d["totals"]["compression_vs_f32"] == 2.0 and d["totals"]["compression_vs_f16"] == 1.0
    assert d["layers"][0]["k"]["row_format"] == "f16"
    d = json.loads(_dump(*dims, "--cache", "f32").stdout)
    assert d["mode"] == "f32" and d["totals"]["bytes"] == 30 * 2 * 3 * 1024 * 64 * 4
    assert d["totals"]["compression_vs_f32"] == 1.0


@pytest.mark.parametrize("args,needle", [
    (["/no/such/file.q42art"], "No such file"),
    (["--n-layers", "2"], "--n-kv-heads"),
    (["--n-layers", "2", "--n-kv-heads", "1", "--head-dim", "8", "--layer", "5"], "--layer 5"),
])
def test_bad_input_exits_non_zero(args, needle):
    out = _dump(*args)
    assert out.returncode == 1 and out.stdout == ""
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_corrupt_and_mismatched_artifact(art_path, tmp_path):
    p, _ = art_path
    bad = tmp_path / "bad.q42art"
    bad.write_bytes(p.read_bytes()[:-3])
    out = _dump(bad)
    assert out.returncode == 1 and "PayloadLength" not in out.stdout and "payload" in out.stderr
    out = _dump(p, "--head-dim", 64)
    assert out.returncode == 1 and "disagrees" in out.stderr


def test_uncertified_artifact_is_shown_as_such(tmp_path):
    rng = np.random.default_rng(5)
    art = toy_artifact(rng, n_layers=1, n_atoms=8, head_dim=4, s=2)
    p = tmp_path / "failed.q42art"
    A.write_artifact(p, art, toy_cert(art, passed=False))
    d = dump.describe(L.build_layout(1, 2, 4, 8, art), A.read_header(p), str(p))
    assert d["certification"]["passed"] is False
    assert "NOT CERTIFIED" in dump.format_table(d)


@pytest.mark.gpu
@pytest.mark.parametrize("f32", [False, True])
def test_dump_matches_the_arena_kvarena_allocates(art_path, f32, make_arena, activate):
    """Every layer buffer KvArena allocates has the size kvdict-dump reports, and the atoms
    and means sit at the words the dump names (read back from the device)."""
    p, art = art_path
    out = _dump(p, "--n-ctx", 100, "--json", *(["--f32"] if f32 else []))
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    if not f32:
        activate(art)
    arena = make_arena(3, 2, 16, 100, guard_words=0, **({"cache": "f32"} if f32 else {}))
    assert arena.mode == d["mode"] == ("f32" if f32 else "dict")
    assert arena.layout.total_bytes == d["totals"]["bytes"]
    assert [4 * arena.memory.layer_buffer(i).words for i in range(3)] == [l["total"]["bytes"] for l in d["layers"]]
    if f32:
        return
    for l in d["layers"]:
        words = arena.layer_words(l["layer"])
        names = [b["name"] for b in l["blocks"]]
        assert ("k atoms_f16" in names) == art.atoms_f16_exact
        for b in l["blocks"]:
            stream, what = b["name"].split(" ", 1)
            sd = art.stream(l["layer"], stream == "k")
            got = words[b["word"]:b["word"] + b["words"]].view(np.float32)
            if sd is None and what != "region":  # a passthrough stream's share of the tail: zeros
                assert not got.any()
            elif what == "atoms":
                assert np.array_equal(got, sd.atoms.astype(np.float32).reshape(-1))
            elif what == "atoms_f16":
                halves = got.view(np.float16).astype(np.float32).reshape(-1, 16)
                assert np.array_equal(halves, sd.atoms.reshape(-1, 16)[:, R.atoms_f16_order(16)])
            elif what == "mean":
                assert np.array_equal(got, sd.mean.astype(np.float32).reshape(-1))
