"""kvdict_vk.vk.abi: the one declaration of every shader variant, held against the built
SPIR-V (bindings, push size, specialization IDs, workgroup size, capabilities), against
shader_build and SHADERS, and loadable without the package (setup.py's path)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvdict_vk.vk import abi, shader_build as sb, spirv
import kvdict_vk.vk.attend.specs  # noqa: F401 (registers its variants' dispatch arithmetic)
import kvdict_vk.vk.encode.specs  # noqa: F401 (the same)
import kvdict_vk.vk.forward.specs  # noqa: F401 (the same)
from kvdict_vk.vk.shaders import SHADERS
from kvdict_vk.vk.vulkan_info import SUBGROUP_OPERATIONS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(abi.DECLARATIONS))
def test_spirv_reflection_matches_the_declaration(name):
    decl = abi.DECLARATIONS[name]
    r = spirv.reflect(spirv.load(name))
    # bindings 0 .. n-1 of set 0, each its GLSL block, element width and writability
    assert r.bindings == tuple((0, i) for i in range(len(decl.bindings)))
    assert r.buffers == tuple((b.name, b.lanes, b.writes) for b in decl.bindings), name
    assert r.push_constant_bytes == decl.push.size_bytes
    assert r.spec_ids == tuple(range(len(decl.spec)))
    assert r.local_size == (abi.WG_SIZE, 1, 1)  # the literal size (the default where specialized)
    if isinstance(decl.local, str):  # local_size_x_id: the declared constant's id
        assert r.local_size_spec_id == decl.spec.index(decl.local)
    else:
        assert r.local_size_spec_id is None and decl.local == abi.WG_SIZE
    # the capabilities beyond Shader are exactly the declared subgroup classes' and features'
    used = {spirv.SUBGROUP_CAPABILITIES[c] for c in r.capabilities if c in spirv.SUBGROUP_CAPABILITIES}
    features = {c for f in decl.features for c in abi.FEATURE_CAPABILITIES[f][0]}
    assert used == set(decl.subgroup_ops) and set(r.capabilities) - set(spirv.SUBGROUP_CAPABILITIES) - features == {1}
    assert all(set(abi.FEATURE_CAPABILITIES[f][0]) & set(r.capabilities) for f in decl.features), name
    spirv.check_portable(name, r, subgroup_ops=decl.subgroup_ops, features=decl.features)


def test_declarations_are_consistent():
    assert set(abi.DECLARATIONS) == set(sb.VARIANTS) == set(SHADERS)
    assert sb.VARIANTS is abi.VARIANTS
    for name, decl in abi.DECLARATIONS.items():
        assert (ROOT / "shaders" / decl.source).is_file(), decl.source
        assert sb.VARIANTS[name] == (decl.source, dict(decl.defines))
        assert set(decl.subgroup_ops) <= set(SUBGROUP_OPERATIONS) and set(decl.features) <= set(abi.FEATURES)
        spec = SHADERS[name]
        assert spec.decl is decl and spec.push is decl.push and spec.spec_names == decl.spec
        assert (spec.lanes, spec.writes) == (decl.lanes, decl.writes)
        assert all(b.lanes in (1, 2, 4) for b in decl.bindings)
        assert any(b.writes for b in decl.bindings), name  # kernels.Kernel chunks by the written view
        # a specialized workgroup size is the spec constant LOCAL (the engines' name for it)
        assert ("LOCAL" in decl.spec) == isinstance(decl.local, str) and decl.local in (abi.WG_SIZE, "LOCAL")


def test_inconsistent_declarations_are_refused():
    blk = abi.uint_block("T", "a")
    ok = dict(name="t", source="t.comp", defines=(), bindings=(abi.rw("B"),), push=blk, spec=("X",))
    abi.Variant(**ok)
    for bad in (dict(optional_spec=(("Y", 0),)), dict(local="Y"), dict(features=("teleport",)),
                dict(spec=("X", "X")), dict(bindings=())):
        with pytest.raises(ValueError):
            abi.Variant(**{**ok, **bad})


def test_abi_imports_only_the_standard_library():
    tree = ast.parse((ROOT / "kvdict_vk" / "vk" / "abi.py").read_text())
    for node in tree.body:  # module level: absolute imports of the standard library only
        for n in ast.walk(node) if isinstance(node, ast.Try) else [node]:
            if isinstance(n, ast.Import):
                assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                assert n.module.split(".")[0] in sys.stdlib_module_names or n.module == "__future__"
            elif isinstance(n, ast.ImportFrom):  # the package's errors, with a fallback (by path)
                assert isinstance(node, ast.Try) and n.module == "errors"


def test_shader_build_loads_by_path_without_the_package(tmp_path):
    """setup.py's view: shader_build.py (and through it abi.py) loaded by file path, outside
    the package — no kvdict_vk import, no numpy."""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        s = importlib.util.spec_from_file_location("sb", {str(ROOT / "kvdict_vk" / "vk" / "shader_build.py")!r})
        m = importlib.util.module_from_spec(s)
        s.loader.exec_module(m)
        assert "numpy" not in sys.modules and not any(k.startswith("kvdict_vk") for k in sys.modules)
        print(len(m.VARIANTS), sorted(m.VARIANTS) == sorted(set(m.VARIANTS)))
    """)
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(abi.DECLARATIONS)), "True"]


def test_a_variant_whose_wing_is_not_registered_is_a_typed_error(monkeypatch):
    from kvdict_vk import errors as E
    from kvdict_vk.vk import shaders
    monkeypatch.delitem(shaders.SHADERS, "attend_flash")
    with pytest.raises(E.DispatchError, match="no dispatch arithmetic registered"):
        shaders.spec("attend_flash")
    with pytest.raises(E.DispatchError, match="unknown shader variant"):
        shaders.spec("no_such_variant")
    with pytest.raises(ValueError, match="undeclared"):
        shaders.register({"no_such_variant": lambda p, s: []})


def _glsl_defines(source: str, prefix: str) -> dict:
    """The ``#define PREFIXNAME Nu`` constants of a shader source, by NAME."""
    text = (ROOT / "shaders" / source).read_text()
    return {m[1].lower(): int(m[2]) for m in re.finditer(rf"^#define {prefix}(\w+) (\d+)u", text, re.M)}


def test_glsl_constants_are_their_python_twins():
    """The constants a shader and its Python side both name — rows_encode.glsl's append formats
    and fwd_qkv.comp's KIVI one, weights.glsl's weight formats and block sizes, matvec.glsl's x
    modes and the stage fwd_qkv's KIVI append borrows — agree."""
    from kvdict_vk import kivi as K, rows as R
    from kvdict_vk.vk.forward import specs as fwd_specs
    from kvdict_vk.vk.forward import weights as W
    assert _glsl_defines("rows_encode.glsl", "FORMAT_") == R.APPEND_FORMATS
    assert {**R.APPEND_FORMATS, **_glsl_defines("fwd_qkv.comp", "QKV_")} == R.QKV_FORMATS
    assert _glsl_defines("weights.glsl", "W_") == W.FORMATS
    assert _glsl_defines("matvec.glsl", "X_") == fwd_specs.X_MODES
    text = (ROOT / "shaders" / "weights.glsl").read_text()
    m = re.search(r"BLOCK_WORDS = FORMAT == W_F32 \? (\d+)u : \(FORMAT == W_Q4_1 \? (\d+)u : (\d+)u\)", text)
    assert m and tuple(map(int, m.groups())) == tuple(W.BLOCK_WORDS[f] for f in ("f32", "q4_1", "q8_0"))
    m = re.search(r"const uint X_SHARED = (\d+)u;", (ROOT / "shaders" / "matvec.glsl").read_text())
    assert m and R.MATVEC_STAGE_WORDS == int(m[1]) and R.QKV_KIVI_MAX_HEAD_DIM * K.GROUP // 2 <= int(m[1])


def test_qkv_appends_declare_what_they_write():
    """fwd_qkv appending a layer's token itself: over q8_0 rows and a KIVI layer it writes the
    source rows and the arrival words besides the layer (a KIVI layer's regions, statistics,
    rings and state word); rows that are not head_dim's words, a KIVI specialization of another
    head_dim or bits, or a q8_0 head_dim off the block size are refused before any dispatch."""
    from kvdict_vk import errors as E
    from kvdict_vk import kivi as K
    from kvdict_vk import layout as L
    from kvdict_vk import rows as R
    from kvdict_vk.vk import shaders
    from kvdict_vk.vk.forward import specs  # noqa: F401  (registers the forward's variants)
    qkv = shaders.spec("fwd_qkv")
    hd, n_kv, n_ctx = 64, 2, 100
    base = dict(w_word=0, x_word=0, n_cols=96, q_rows=4 * hd, k_rows=n_kv * hd, y_word=0, k_word=1000, v_word=2000,
                head_dim=hd, rope_dim=hd, pos_word=0, n_pos=n_ctx, norm_word=0, n_ctx=n_ctx, k_pre_word=0, eps=1e-5,
                k_layer_word=0, v_layer_word=50000, arrival_word=3000)
    spec = dict(FORMAT=0, ROW_THREADS=8, X_MODE=1, HEAD_DIM=hd, K_BITS=4, V_BITS=2)
    q8 = dict(base, row_words=L.row_words(hd, 0, 0, "q8_0"), row_format=R.QKV_FORMATS["q8_0"])
    spans = qkv.extents(q8, spec)
    assert (3000, 3000 + R.qkv_arrival_words(n_kv, hd)) in spans[3] and (1000, 1000 + n_kv * hd) in spans[3]
    assert spans[6] == [(0, n_kv * n_ctx * q8["row_words"]), (50000, 50000 + n_kv * n_ctx * q8["row_words"])]
    kivi = dict(base, row_words=K.key_row_words(hd, 4), row_format=R.QKV_FORMATS["kivi"], stats_word=90000,
                k_window_word=95000, v_window_word=97000, recent=8, state_word=99999)
    spans = qkv.extents(kivi, spec)
    assert (99999, 100000) in spans[6] and (90000, 90000 + n_kv * K.stats_words_per_head(n_ctx, hd)) in spans[6]
    assert (3000, 3000 + R.qkv_arrival_words(n_kv, hd)) in spans[3]
    f16 = dict(base, row_words=hd // 2, row_format=R.QKV_FORMATS["f16"])
    assert qkv.extents(f16, spec)[3] == []  # f16 rows go straight into the layer
    # a batch of 3: each sequence's queries, rows and position, packed; a layer's rows only for one
    batch = qkv.extents(dict(base, row_words=0, row_format=0, n_seqs=3), spec)
    assert batch[2] == [(0, 3 * 4 * hd)] and batch[3] == [(1000, 1000 + 3 * n_kv * hd), (2000, 2000 + 3 * n_kv * hd)]
    assert batch[1] == [(0, 3 * 96)] and batch[5] == [(0, 3)]
    with pytest.raises(E.DispatchError):
        qkv.extents(dict(f16, n_seqs=2), spec)
    with pytest.raises(E.DispatchError):  # sequences a workgroup at once: a batch's, no layer rows
        qkv.extents(f16, dict(spec, SEQ_TILE=2))
    with pytest.raises(E.DispatchError):
        qkv.extents(dict(base, row_words=0, row_format=0, n_seqs=3), dict(spec, SEQ_TILE=9))
    for bad, bad_spec in ((dict(q8, row_words=q8["row_words"] + 1), spec), (kivi, dict(spec, HEAD_DIM=32)),
                          (kivi, dict(spec, K_BITS=9)), (dict(kivi, row_words=K.key_row_words(hd, 2)), spec),
                          (dict(q8, head_dim=48, rope_dim=48, q_rows=4 * 48, k_rows=n_kv * 48,
                                row_words=L.row_words(48, 0, 0, "q8_0")), spec)):
        with pytest.raises(E.DispatchError, match="fwd_qkv"):
            qkv.extents(bad, bad_spec)
