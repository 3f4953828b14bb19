"""Every shader variant's contract, declared once: the ABI between Python and shaders/*.comp.

A :class:`Variant` names its SPIR-V output, its source file and preprocessor defines (what
:mod:`kvdict_vk.vk.shader_build` compiles), its storage-buffer bindings (by binding number:
the GLSL block name, the element width in 32-bit words — "lanes", 4 for vec4/uvec4 views — and
whether the shader writes it), its push-constant block (:class:`PushBlock`: the GLSL struct
name and its ordered 32-bit fields, with the defaults a caller may omit), its specialization
constants by constant_id (and which may be omitted, with their defaults), its workgroup size
(common.glsl's fixed WG_SIZE, or the specialization constant its ``local_size_x_id`` names)
and the optional device features it needs (subgroup operation classes; ``features`` for
the rest). Tests hold the declarations against the GLSL (the push blocks) and against the
built SPIR-V's reflection (bindings, push size, specialization IDs, workgroup size).

What a dispatch touches for given push constants — the bounds checks, arena arithmetic —
stays beside that arithmetic (kvdict_vk/vk/extents.py, attend/specs.py, encode/specs.py,
forward/specs.py); kvdict_vk/vk/shaders.py joins the two into ``SHADERS``.

Standard library only: setup.py loads shader_build.py by path at wheel-build time, and
shader_build loads this file the same way (``PushBlock.pack`` imports numpy when called).
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    from ..errors import DispatchError
except ImportError:  # loaded by path (shader_build from setup.py), outside the package
    class DispatchError(Exception):
        pass

WORD_BYTES = 4
WG_SIZE = 64  # common.glsl's WG_SIZE: the local_size_x of every shader that does not specialize it
# optional device features a variant may need beyond Vulkan 1.1 core compute, besides
# subgroup operation classes (Variant.subgroup_ops): vulkan_info reads which the device
# reports, kp enables them at device creation (scripts/kp_patch.py; ENABLED_FEATURES below),
# kernels.Kernel refuses a variant whose feature the device lacks. cooperative_matrix is the KHR
# extension (reported only: Debian 12's glslang cannot build it), cooperative_matrix_nv the NV one
# with the shape attend_mma uses (vulkan_info.COOPMAT_NV_SHAPE).
FEATURES = ("float16", "int8", "integer_dot", "cooperative_matrix", "cooperative_matrix_nv", "float_atomics")
# the FEATURES kp enables at device creation where the device reports them (scripts/kp_patch.py,
# item 4)
ENABLED_FEATURES = ("float16", "int8", "integer_dot", "cooperative_matrix_nv", "float_atomics")
# SPIR-V capabilities and extensions by the FEATURE that allows them (a variant declaring the
# feature may use them). cooperative_matrix_nv: glslang builds GL_NV_cooperative_matrix under the
# Vulkan memory model, so kp enables vulkanMemoryModel with it (vulkan_info.FEATURE_NEEDS).
FEATURE_CAPABILITIES = {
    "float16": ((9,), ()),  # Float16
    "int8": ((39,), ()),  # Int8
    "integer_dot": ((6018, 6019), ("SPV_KHR_integer_dot_product",)),  # DotProduct on packed 4 × 8-bit words
    "cooperative_matrix": ((6022,), ("SPV_KHR_cooperative_matrix",)),
    "cooperative_matrix_nv": ((5345, 5357), ("SPV_KHR_vulkan_memory_model", "SPV_NV_cooperative_matrix")),
    "float_atomics": ((6033,), ("SPV_EXT_shader_atomic_float_add",)),
}


# --- push-constant blocks (the ONE definition; GLSL mirrors it, a test checks) ----------------

@dataclass(frozen=True)
class PushBlock:
    """A GLSL ``layout(push_constant) uniform <name> { … }`` block of 32-bit scalars.
    Packed as uint32 words — floats bit-cast — because Kompute takes the push-constant
    dtype from the specialization constants, which are uint32 (docs/DESIGN.md, "Building kp")."""
    name: str
    fields: tuple  # ((field name, "uint" | "float"), …) in declaration order
    defaults: tuple = ()  # ((field name, value), …): fields a caller may omit

    @property
    def size_bytes(self) -> int:
        return len(self.fields) * WORD_BYTES

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.fields)

    def pack(self, **values):
        """The words (a numpy uint32 array) of these field values, defaults filled in."""
        import numpy as np  # at dispatch time only: the module itself stays standard-library

        values = {**dict(self.defaults), **values}
        missing = [n for n in self.field_names if n not in values]
        extra = sorted(set(values) - set(self.field_names))
        if missing or extra:
            raise DispatchError(f"{self.name}: missing {missing}, unknown {extra}")
        out = np.empty(len(self.fields), np.uint32)
        for i, (n, t) in enumerate(self.fields):
            v = values[n]
            if t == "float":
                out[i] = np.array([v], np.float32).view(np.uint32)[0]
            else:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise DispatchError(f"{self.name}.{n}: {v!r} is not an integer")
                if not 0 <= int(v) < 1 << 32:
                    raise DispatchError(f"{self.name}.{n} = {v} does not fit a uint32")
                out[i] = int(v)
        return out

    def unpack(self, words) -> dict:
        import numpy as np

        w = np.asarray(words, np.uint32)
        if w.shape != (len(self.fields),):
            raise DispatchError(f"{self.name}: {w.shape} words, expected {len(self.fields)}")
        return {n: (float(w[i:i + 1].view(np.float32)[0]) if t == "float" else int(w[i]))
                for i, (n, t) in enumerate(self.fields)}


def uint_block(name: str, *names: str, floats: tuple = (), defaults: dict | None = None) -> PushBlock:
    """A block of uint fields ``names``, then float fields ``floats``."""
    return PushBlock(name, tuple((n, "uint") for n in names) + tuple((n, "float") for n in floats),
                     tuple((defaults or {}).items()))


# Offsets are in words (4 bytes) in every block, even for the vec4 variants: the shader
# divides, Python checks the alignment. The reconstruct block's last three fields serve
# per-head dictionaries (KV head h reads atoms at atoms_word + h·head_atoms, its mean and
# residual scale at mean_word/scale_word + h·head_vec; both strides 0 when shared) and
# the residual stage (scale_word is read only when the shader's RES_BITS > 0). The atoms are
# binary16 where the specialization constant ATOMS_F16 says so (chunk-pair order,
# rows.atoms_f16_order; shaders/atoms.glsl), head_atoms then counting their words.
RECONSTRUCT_PUSH = uint_block("ReconstructPush", "src_word", "atoms_word", "mean_word", "n_atoms",
                              "n_ctx", "t0", "n_tok", "n_rows", "out_word", "scale_word", "head_atoms",
                              "head_vec", defaults=dict(scale_word=0, head_atoms=0, head_vec=0))
COPY_ROWS_PUSH = uint_block("CopyRowsPush", "src_word", "n_ctx", "t0", "n_tok", "n_rows", "out_word")
READ_KIVI_PUSH = uint_block("ReadKiviPush", "src_word", "n_ctx", "t0", "n_tok", "n_rows", "out_word",
                            "stats_word", "window_word", "window", "state_word", "seq_ctx")
# a dict-coded stream's exact window over a read's rows (shaders/read_window.comp)
READ_WINDOW_PUSH = uint_block("ReadWindowPush", "window_word", "rows", "sink", "recent", "state_word", "n_kv",
                              "t0", "n_tok", "out_word")
# keys coded before RoPE (kvdict_vk.rope) turned in place over a read's K rows (shaders/rope_rows.comp)
ROPE_ROWS_PUSH = uint_block("RopeRowsPush", "table_word", "hi_rows", "shift", "t0", "n_tok", "n_rows", "out_word")
SCATTER_PUSH = uint_block("ScatterPush", "src_word", "dst_word", "row_words", "group_rows",
                          "group_stride", "n_words")
APPEND_STEP_PUSH = uint_block("AppendStepPush", "k_src_word", "v_src_word", "k_word", "v_word", "k_row_words", "v_row_words",
                              "n_kv", "n_seqs", "n_ctx", "seq_rows", "lengths_word", "k_format", "v_format",
                              "head_dim")
# a recorded step's append to a KIVI layer (one sequence): its rows into the rings, a group
# leaving the window quantised on the device (shaders/append_kivi.comp)
APPEND_KIVI_PUSH = uint_block("AppendKiviPush", "k_src_word", "v_src_word", "k_word", "v_word", "stats_word",
                              "k_window_word", "v_window_word", "recent", "state_word", "n_kv", "n_ctx",
                              "lengths_word", "n_seqs", "seq_rows")
# a recorded step's new token into a windowed dictionary layer's exact window (shaders/append_window.comp)
APPEND_WINDOW_PUSH = uint_block("AppendWindowPush", "k_rows_word", "v_rows_word", "k_window_word", "v_window_word",
                                "rows", "sink", "recent", "state_word", "n_kv", "head_dim", "lengths_word")
COPY_PUSH = uint_block("CopyPush", "src_word", "dst_word", "n_words")
FLUSH_PUSH = uint_block("FlushPush", "n_words")
# A model's forward on the device (shaders/fwd_*.comp, kvdict_vk/vk/forward/).
# n_seqs: a batch's sequences (fwd_qkv: theirs packed as a DecodeStep holds them; fwd_matvec: x_seq_words and
# y_seq_words apart; fwd_embed, fwd_argmax: their rows packed), strided over by the workgroups' rows
MATVEC_PUSH = uint_block("MatvecPush", "w_word", "x_word", "y_word", "n_rows", "n_cols", "accumulate", "norm_word",
                         "n_seqs", "x_seq_words", "y_seq_words", floats=("eps",),
                         defaults=dict(accumulate=0, norm_word=0, n_seqs=1, x_seq_words=0, y_seq_words=0, eps=0.0))
# row_words (0: none), row_format (kvdict_vk.rows.APPEND_FORMATS), k/v_layer_word, n_ctx: fwd_qkv writing
# the token's rows into the layer itself (DecodeStep.row_append); k_pre_word (0: none): the keys
# before RoPE too, for a layer that codes them so (DecodeStep.k_pre_word); arrival_word: q8_0 and
# KIVI layers' arrival words in Rows; stats_word … state_word: a KIVI layer's (fwd_qkv.comp)
QKV_PUSH = uint_block("QkvPush", "w_word", "x_word", "n_cols", "q_rows", "k_rows", "y_word", "k_word", "v_word",
                      "head_dim", "rope_dim", "pos_word", "n_pos", "norm_word", "row_words", "row_format",
                      "k_layer_word", "v_layer_word", "n_ctx", "k_pre_word", "arrival_word", "stats_word",
                      "k_window_word", "v_window_word", "recent", "state_word", "n_seqs", floats=("eps",),
                      defaults=dict(row_words=0, row_format=0, k_layer_word=0, v_layer_word=0, n_ctx=1,
                                    k_pre_word=0, arrival_word=0, stats_word=0, k_window_word=0, v_window_word=0,
                                    recent=0, state_word=0, n_seqs=1))
EMBED_PUSH = uint_block("EmbedPush", "w_word", "token_word", "y_word", "n_rows", "n_cols", "n_seqs",
                        defaults=dict(n_seqs=1))
ARGMAX_PUSH = uint_block("ArgmaxPush", "x_word", "n", "out_word", "parts", "stage", "n_seqs",
                         defaults=dict(n_seqs=1))
# Decode attention (shaders/attend_*.comp, kvdict_vk/vk/attend/).
ATTEND_SPLIT_PUSH = uint_block("AttendSplitPush", "k_word", "v_word", "n_ctx", "n_used", "split_len", "n_splits",
                               "n_kv", "n_atoms", "k_sparsity", "v_sparsity", "k_scale_word", "v_scale_word",
                               "head_vec", floats=("score_scale",))
ATTEND_TABLE_PUSH = uint_block("AttendTablePush", "atoms_word", "head_atoms", "n_atoms", "n_kv", "n_seqs", "q_word",
                               defaults=dict(n_seqs=1, q_word=0))
ATTEND_COMBINE_PUSH = uint_block("AttendCombinePush", "n_kv", "n_splits", "f_word", "inv_l_word")
ATTEND_ATOMS_PUSH = uint_block("AttendAtomsPush", "atoms_word", "head_atoms", "n_atoms", "n_kv", "n_splits",
                               "f_word")
ATTEND_REDUCE_PUSH = uint_block("AttendReducePush", "n_kv", "n_splits", "f_word", "inv_l_word", "n_blocks",
                                "use_mean", "mean_word", "head_vec")
# a windowed dictionary layer (kvdict_vk.window; shaders/window.glsl): the coded passes skip
# the window's tokens, attend_window attends over them; win_sink + win_recent 0: no window
_WINDOW_WORDS = ("win_sink", "win_recent", "state_word")
_NO_WINDOW = dict(win_sink=0, win_recent=0, state_word=0)
# keys coded before RoPE (kvdict_vk.rope, shaders/rope.glsl; attend_direct's and attend_flash_coded's K_ROPE builds): the K
# mean (which no longer cancels in the softmax once a key turns) and the rotation table
_ROPE_WORDS = ("k_mean_word", "rope_word", "rope_hi", "rope_shift")
_NO_ROPE = dict.fromkeys(_ROPE_WORDS, 0)
ATTEND_DIRECT_PUSH = uint_block("AttendDirectPush", "k_word", "v_word", "n_ctx", "fresh_k_word", "fresh_v_word",
                                "t_first", "n_used", "n_cached", "split_len", "n_splits", "split0", "n_kv",
                                "n_atoms", "k_atoms_word", "v_atoms_word", "head_atoms", "k_scale_word",
                                "v_scale_word", "head_vec", "write_out", "use_mean", "mean_word",
                                *_ROPE_WORDS, *_WINDOW_WORDS, floats=("score_scale",),
                                defaults={**_NO_ROPE, **_NO_WINDOW})
# the flash paths batch sequences (n_seqs, seq_rows, seq_heads: shaders/attend_common.glsl);
# attend_flash's KIVI builds (one sequence) read a KIVI layer's keys' group statistics, its two
# exact windows (rings of `window` binary16 rows) and its state word (the quantised end)
_KIVI_WORDS = ("stats_word", "k_window_word", "v_window_word", "window", "state_word")
# split_len 0: each sequence's splits derived from its n_used in rounds of split_round tokens
# (attend_common.glsl's SPLIT_LEN); q_word: where the query block starts in Query (a multiple
# of 4) — both a recorded decode step's (kvdict_vk/vk/arena/decode.py)
ATTEND_FLASH_PUSH = uint_block("AttendFlashPush", "k_word", "v_word", "n_ctx", "n_used", "split_len", "n_splits",
                               "n_kv", "n_seqs", "seq_rows", *_KIVI_WORDS, "split_round", "q_word",
                               floats=("score_scale",),
                               defaults=dict(n_seqs=1, seq_rows=0, split_round=1, q_word=0,
                                             **{n: 0 for n in _KIVI_WORDS}))
ATTEND_FLASH_CODED_PUSH = uint_block("AttendFlashCodedPush", "k_word", "v_word", "n_ctx", "n_used", "split_len",
                                     "n_splits", "n_kv", "v_atoms_word", "head_atoms", "k_scale_word",
                                     "v_scale_word", "head_vec", "n_seqs", "seq_rows", "split_round", "q_word",
                                     *_WINDOW_WORDS, "k_atoms_word", *_ROPE_WORDS, floats=("score_scale",),
                                     defaults=dict(n_seqs=1, seq_rows=0, split_round=1, q_word=0, k_atoms_word=0,
                                                   **_NO_ROPE, **_NO_WINDOW))
ATTEND_WINDOW_PUSH = uint_block("AttendWindowPush", "k_window_word", "v_window_word", "rows", "sink", "recent",
                                "state_word", "k_mean_word", "v_mean_word", "head_vec", "n_kv", "n_used", "split0",
                                "n_seqs", "q_word", "score_k_mean", floats=("score_scale",),
                                defaults=dict(n_seqs=1, q_word=0, score_k_mean=0))
ATTEND_MERGE_PUSH = uint_block("AttendMergePush", "n_kv", "n_splits", "use_mean", "mean_word", "head_vec")
ATTEND_MERGE_HEAD_PUSH = uint_block("AttendMergeHeadPush", "n_kv", "n_splits", "use_mean", "mean_word",
                                    "head_vec", "seq_heads", "out_word", defaults=dict(out_word=0))
# GPU OMP encoder (shaders/omp_encode_*.comp, kvdict_vk/vk/encode/): one block for its
# kernels; shaders/encode_common.glsl says what each field is.
ENCODE_PUSH = uint_block("EncodePush", "phase", "step", "group0", "block", "dict_head", "n_tok",
                         "n_vectors", "n_atoms", "per_head", "atoms_word", "inv_norm_word", "mean_word",
                         "metric_word", "raw_atoms_word", "scale_word", "steps_word", "res_word",
                         "basis_word", "dst_word", "n_ctx", "t0", "atoms_t_word", "atoms_pad", "x_word",
                         defaults=dict(atoms_t_word=0, atoms_pad=0, x_word=0))


# --- variants ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Binding:
    """One storage buffer: its GLSL block name, words per element of the shader's view of
    it (4 for vec4/uvec4, 2 for vec2/uvec2, 1 for uint/float), whether the shader writes it."""
    name: str
    lanes: int = 1
    writes: bool = False


def ro(name: str, lanes: int = 1) -> Binding:
    return Binding(name, lanes, False)


def rw(name: str, lanes: int = 1) -> Binding:
    return Binding(name, lanes, True)


@dataclass(frozen=True)
class Variant:
    name: str  # the SPIR-V module's name (kvdict_vk/spv/<name>.spv)
    source: str  # shaders/<source>
    defines: tuple  # ((macro, value), …) for glslangValidator -D
    bindings: tuple  # Binding per binding number 0 .. n-1 (set 0)
    push: PushBlock
    spec: tuple = ()  # specialization constant names by constant_id 0 .. n-1
    optional_spec: tuple = ()  # ((name, default), …): may be omitted, and may be 0
    local: int | str = WG_SIZE  # workgroup size: fixed, or the spec constant local_size_x_id names
    subgroup_ops: tuple = ()  # subgroup operation classes it uses (the device must report them)
    features: tuple = ()  # other optional device features it needs (FEATURES)

    def __post_init__(self):
        names = set(self.spec)
        bad = ([n for n, _ in self.optional_spec if n not in names] + [f for f in self.features if f not in FEATURES]
               + ([self.local] if isinstance(self.local, str) and self.local not in names else []))
        if bad or len(names) != len(self.spec) or not self.bindings:
            raise ValueError(f"abi.{self.name}: inconsistent declaration ({bad})")

    @property
    def lanes(self) -> tuple:
        return tuple(b.lanes for b in self.bindings)

    @property
    def writes(self) -> tuple:
        return tuple(b.writes for b in self.bindings)

    @property
    def defines_dict(self) -> dict:
        return dict(self.defines)


_SG = ("basic", "shuffle")  # attend_flash's SUBGROUP build: a token's partial scores summed by shuffles
_MMA_SG = ("basic", "vote", "shuffle")  # attend_mma: a tile's maxima and sums across its lanes
MMA_FEATURES = ("float16", "cooperative_matrix_nv")  # attend_mma's binary16 matrices
ATTEND_SPEC = ("HEAD_DIM", "GROUP", "LOCAL", "HB")  # attend_common.glsl's (LOCAL: local_size_x_id 2)


def _attend(name: str, bindings: tuple, push: PushBlock, spec: tuple = ATTEND_SPEC, *, source: str = "",
            defines: tuple = (), optional: tuple = (), subgroup_ops: tuple = (), features: tuple = ()) -> Variant:
    return Variant(name, source or f"{name}.comp", defines, bindings, push, spec, optional, "LOCAL", subgroup_ops,
                   features)


def _declare() -> tuple:
    out = []
    for v, n in (("vec4", 4), ("scalar", 1)):
        out.append(Variant(f"reconstruct_{v}", "reconstruct.comp", (("VEC4", int(n == 4)),),
                           (ro("LayerWords"), ro("LayerElems", n), rw("OutElems", n), ro("LayerQuads", 4)),
                           RECONSTRUCT_PUSH, ("HEAD_DIM", "SPARSITY", "CHUNKS", "RES_BITS", "PIPELINED", "ATOMS_F16"),
                           (("RES_BITS", 0), ("PIPELINED", 0), ("ATOMS_F16", 0))))
    for v, n in (("vec4", 4), ("scalar", 1)):
        out.append(Variant(f"copy_rows_{v}", "copy_rows.comp", (("VEC4", int(n == 4)),),
                           (ro("LayerElems", n), rw("OutElems", n)), COPY_ROWS_PUSH, ("HEAD_DIM", "CHUNKS")))
    for v, n in (("vec4", 4), ("scalar", 1)):
        out.append(Variant(f"copy_{v}", "copy.comp", (("VEC4", int(n == 4)),), (ro("Src", n), rw("Dst", n)),
                           COPY_PUSH))
    out += [
        Variant("l2_flush", "l2_flush.comp", (), (ro("Src", 4), rw("Sink")), FLUSH_PUSH),
        Variant("scatter", "scatter.comp", (), (ro("Upload"), rw("Layer")), SCATTER_PUSH),
        Variant("append_step", "append_step.comp", (), (ro("Step"), ro("Query"), rw("Layer")), APPEND_STEP_PUSH),
        Variant("append_kivi", "append_kivi.comp", (), (ro("Step"), ro("Query"), rw("Layer")), APPEND_KIVI_PUSH,
                ("HEAD_DIM", "K_BITS", "V_BITS")),
        Variant("append_window", "append_window.comp", (), (ro("Step"), ro("Query"), rw("Layer")), APPEND_WINDOW_PUSH),
        Variant("read_rows_f16", "read_rows_f16.comp", (), (ro("LayerWords"), rw("OutPairs", 2)), COPY_ROWS_PUSH,
                ("HEAD_DIM",)),
        Variant("read_rows_q8", "read_rows_q8.comp", (), (ro("LayerWords"), rw("OutQuads", 4)), COPY_ROWS_PUSH,
                ("HEAD_DIM",)),
        Variant("read_rows_kivi", "read_rows_kivi.comp", (), (ro("LayerWords"), rw("OutQuads", 4)), READ_KIVI_PUSH,
                ("HEAD_DIM", "BITS", "KEYS", "GROUP"), (("KEYS", 1),)),
        Variant("read_window", "read_window.comp", (), (ro("LayerWords"), rw("OutPairs", 2)), READ_WINDOW_PUSH,
                ("HEAD_DIM",)),
        Variant("rope_rows", "rope_rows.comp", (), (ro("LayerQuads", 4), rw("Rows", 4)), ROPE_ROWS_PUSH,
                ("HEAD_DIM",)),
    ]
    # a model's forward (kvdict_vk/vk/forward/): FORMAT is weights.glsl's weight format
    # FORMAT: weights.glsl's weight format; X_MODE: how matvec.glsl reads x
    matvec_spec = (("FORMAT", "ROW_THREADS", "X_MODE"), (("FORMAT", 0), ("X_MODE", 0)))
    # fwd_qkv's KIVI layer (kivi_append.glsl): head_dim and its bits, as append_kivi's
    qkv_spec = (matvec_spec[0] + ("HEAD_DIM", "K_BITS", "V_BITS", "SEQ_TILE"),
                matvec_spec[1] + (("HEAD_DIM", 64), ("K_BITS", 4), ("V_BITS", 4), ("SEQ_TILE", 1)))
    # fwd_matvec's SEQ_TILE: sequences of a batch a workgroup makes its rows for at once
    matvec_tile_spec = (matvec_spec[0] + ("SEQ_TILE",), matvec_spec[1] + (("SEQ_TILE", 1),))
    out += [
        Variant("fwd_matvec", "fwd_matvec.comp", (), (ro("Weights"), ro("X"), rw("Y")), MATVEC_PUSH,
                *matvec_tile_spec),
        Variant("fwd_qkv", "fwd_qkv.comp", (),
                (ro("Weights"), ro("X"), rw("Y"), rw("Rows"), ro("Table"), ro("Values"), rw("Layer")),
                QKV_PUSH, *qkv_spec),
        # the same, a row's lanes added by subgroup shuffles (GPUs that have them)
        Variant("fwd_matvec_sg", "fwd_matvec.comp", (("SUBGROUP", 1),), (ro("Weights"), ro("X"), rw("Y")), MATVEC_PUSH,
                *matvec_tile_spec, subgroup_ops=_SG),
        Variant("fwd_qkv_sg", "fwd_qkv.comp", (("SUBGROUP", 1),),
                (ro("Weights"), ro("X"), rw("Y"), rw("Rows"), ro("Table"), ro("Values"), rw("Layer")), QKV_PUSH,
                *qkv_spec,
                subgroup_ops=_SG),
        Variant("fwd_embed", "fwd_embed.comp", (), (ro("Weights"), ro("Values"), rw("State")), EMBED_PUSH,
                ("FORMAT",), (("FORMAT", 0),)),
        Variant("fwd_argmax", "fwd_argmax.comp", (), (ro("X"), rw("Partial"), rw("State")), ARGMAX_PUSH),
    ]
    # decode attention (kvdict_vk/vk/attend/): f32 cache / dict-coded cache
    # ATOMS_F16: the arena keeps the atoms in binary16 (shaders/atoms.glsl)
    coded = ATTEND_SPEC + ("K_CODED", "K_BITS", "V_CODED", "V_BITS")
    direct = ATTEND_SPEC + ("K_SPARSITY", "K_BITS", "V_SPARSITY", "V_BITS", "ROW_HALF", "ATOMS_F16", "K_ROPE")
    flash = ATTEND_SPEC + ("ROW_HALF", "ROW_Q8", "END_ELEMS")
    flash_coded = ATTEND_SPEC + ("K_BITS", "V_BITS", "N_ATOMS", "K_SPARSITY", "V_SPARSITY", "BUCKET", "ATOMS_F16",
                                 "K_ROPE", "KEY_LANES")
    atoms_spec = ATTEND_SPEC + ("ATOMS_F16",)
    merge = (ro("LayerQuads", 4), ro("Stats"), ro("Accs", 4), rw("Out", 4))
    flash_bindings = (ro("CacheWords"), ro("CacheQuads", 4), ro("Query"), rw("Accs"), rw("Stats"))
    out += [
        _attend("attend_split_coded", (ro("LayerWords"), ro("LayerQuads", 4), ro("Query", 4), rw("Accs", 4),
                                       rw("Stats"), ro("Table"), rw("Bins"), rw("Scores")),
                ATTEND_SPLIT_PUSH, coded, source="attend_split.comp",
                optional=tuple((n, 0) for n in coded[4:])),  # 0 = passthrough stream / no residual
        _attend("attend_table", (ro("LayerQuads", 4), ro("Query", 4), rw("Table")), ATTEND_TABLE_PUSH, atoms_spec,
                optional=(("ATOMS_F16", 0),)),
        _attend("attend_combine", (rw("Stats"),), ATTEND_COMBINE_PUSH),
        _attend("attend_atoms", (ro("LayerQuads", 4), ro("Stats"), rw("Bins"), rw("Blocks", 4)), ATTEND_ATOMS_PUSH,
                atoms_spec, optional=(("ATOMS_F16", 0),)),
        _attend("attend_reduce", (ro("LayerQuads", 4), ro("Stats"), ro("Accs", 4), ro("Blocks", 4), rw("Out", 4)),
                ATTEND_REDUCE_PUSH),
        _attend("attend_direct", (ro("CacheWords"), ro("CacheQuads", 4), ro("FreshWords"), ro("FreshQuads", 4),
                                  ro("Query", 4), rw("Accs", 4), rw("Stats"), rw("Out", 4)),
                ATTEND_DIRECT_PUSH, direct, optional=tuple((n, 0) for n in direct[4:])),
        _attend("attend_window", (ro("LayerWords"), ro("Query"), rw("Accs", 4), rw("Stats")), ATTEND_WINDOW_PUSH),
        _attend("attend_merge", merge, ATTEND_MERGE_PUSH),
        _attend("attend_merge_head", merge, ATTEND_MERGE_HEAD_PUSH),
    ]
    flash_optional = (("ROW_HALF", 0), ("ROW_Q8", 0), ("END_ELEMS", 1))
    out.append(_attend("attend_flash", flash_bindings, ATTEND_FLASH_PUSH, flash, optional=flash_optional))
    out.append(_attend("attend_flash_coded", (ro("CacheWords"), ro("CacheQuads", 4), ro("Table"), ro("Query"),
                                              rw("Accs"), rw("Stats")),
                       ATTEND_FLASH_CODED_PUSH, flash_coded,
                       optional=(("K_BITS", 0), ("V_BITS", 0), ("ATOMS_F16", 0), ("K_ROPE", 0), ("KEY_LANES", 1))))
    # attend_flash summing a token's partial scores by subgroup shuffles (GPUs that have them);
    # attend_flash_wide: the split's end in a few barriers (the tuner times it beside attend_flash)
    for name, defines, ops in (("attend_flash_sg", (("SUBGROUP", 1),), _SG),
                               ("attend_flash_wide", (("WIDE_END", 1),), ()),
                               ("attend_flash_wide_sg", (("WIDE_END", 1), ("SUBGROUP", 1)), _SG)):
        out.append(_attend(name, flash_bindings, ATTEND_FLASH_PUSH, flash, source="attend_flash.comp",
                           defines=defines, optional=flash_optional, subgroup_ops=ops))
    # attend_flash over q8_0 rows with the keys' levels dotted with an int8 query by integer dot
    # products (KDOT; devices that report them), with and without shuffles
    for name, defines, ops in (("attend_flash_dot", (("KDOT", 1),), ()),
                               ("attend_flash_dot_sg", (("KDOT", 1), ("SUBGROUP", 1)), _SG)):
        out.append(_attend(name, flash_bindings, ATTEND_FLASH_PUSH, flash, source="attend_flash.comp",
                           defines=defines, optional=flash_optional, subgroup_ops=ops, features=("integer_dot",)))
    # attend_flash over the KIVI cache's words (K_BITS, V_BITS: 2 .. 8; its exact windows are
    # binary16 rows: ROW_HALF 1), with and without shuffles
    for name, defines, ops in (("attend_flash_kivi", (("KIVI", 1),), ()),
                               ("attend_flash_kivi_sg", (("KIVI", 1), ("SUBGROUP", 1)), _SG)):
        out.append(_attend(name, flash_bindings, ATTEND_FLASH_PUSH, flash + ("K_BITS", "V_BITS"),
                           source="attend_flash.comp", defines=defines, optional=flash_optional,
                           subgroup_ops=ops))
    # attend_flash's cooperative-matrix sibling (shaders/attend_mma.comp: GL_NV_cooperative_matrix
    # in binary16 with float32 accumulators; subgroups of 32 with shuffles and votes): the same
    # buffers, push block and records, over rows (f16, q8_0) and the KIVI cache's words
    mma_spec = ATTEND_SPEC + ("ROW_HALF", "ROW_Q8")
    for name, defines, spec in (("attend_mma", (), mma_spec),
                                ("attend_mma_kivi", (("KIVI", 1),), mma_spec + ("K_BITS", "V_BITS"))):
        out.append(Variant(name, "attend_mma.comp", defines, flash_bindings, ATTEND_FLASH_PUSH, spec,
                           (("ROW_HALF", 0), ("ROW_Q8", 0)), "LOCAL", _MMA_SG, MMA_FEATURES))
    # GPU OMP encoder (kvdict_vk/vk/encode/): stepwise kernels, then the one-dispatch ones
    vecs = (("vec4", 4), ("scalar", 1))
    for v, n in vecs:
        out.append(Variant(f"omp_encode_corr_{v}", "omp_encode_corr.comp", (("VEC4", int(n == 4)),),
                           (ro("DictElems", n), ro("StateElems", n), rw("Keys", 2)), ENCODE_PUSH,
                           ("DIM", "ATOM_BLOCK")))
    for v, n in vecs:
        out.append(Variant(f"omp_encode_metric_{v}", "omp_encode_metric.comp", (("VEC4", int(n == 4)),),
                           (ro("DictElems", n), rw("StateElems", n)), ENCODE_PUSH, ("DIM", "METRIC_ROWS")))
    residual = ("RESIDUAL_BITS", "N_STEPS")
    for r in ("", "_residual"):
        for v, n in vecs:
            out.append(Variant(f"omp_encode_pick{r}_{v}", "omp_encode_pick.comp",
                               (("VEC4", int(n == 4)), ("RESIDUAL", int(bool(r)))),
                               (ro("InputElems", n), ro("DictElems", n), ro("DictFloats"), rw("StateElems", n),
                                rw("StateWords"), ro("Keys", 2), rw("Dest")),
                               ENCODE_PUSH, ("DIM", "SPARSITY", "ATOM_BLOCK") + (residual if r else ())))
    for k in ("tiled", "vector"):
        for r in ("", "_residual"):
            for v, n in vecs:
                if k == "tiled":
                    bindings = (ro("InputElems", n), ro("DictElems", n), ro("DictFloats"), rw("StateFloats"),
                                rw("StateWords"), rw("Dest"))
                    spec = ("DIM", "SPARSITY", "TILE_VECTORS", "LOCAL", "CHUNK_DIMS", "METRIC")
                    optional = (("METRIC", 0), ("CHUNK_DIMS", 0))
                    spec += residual if r else ()
                else:
                    bindings = (ro("InputElems", n), ro("DictFloats"), ro("DictVec4", 4), rw("Dest"))
                    spec = ("DIM", "SPARSITY", "LOCAL", "SUM_F", "METRIC") + (residual + ("SUM_D",) if r else ())
                    optional = (("METRIC", 0),)
                out.append(Variant(f"omp_encode_{k}{r}_{v}", f"omp_encode_{k}.comp",
                                   (("VEC4", int(n == 4)), ("RESIDUAL", int(bool(r)))), bindings, ENCODE_PUSH,
                                   spec, optional, "LOCAL"))
    return tuple(out)


DECLARATIONS: dict = {v.name: v for v in _declare()}  # variant name → Variant, in build order

# output name → (source file, preprocessor defines): shader_build's view
VARIANTS: dict = {v.name: (v.source, v.defines_dict) for v in DECLARATIONS.values()}
# struct name → block, and shader source file → the block it declares (every variant of a
# source declares the same one)
PUSH_BLOCKS: dict = {v.push.name: v.push for v in DECLARATIONS.values()}
SHADER_PUSH_BLOCKS: dict = {v.source: v.push for v in DECLARATIONS.values()}


# --- the embedding contract: the declarations as JSON (kvdict_vk/spv/abi.json) ---------------

ABI_SCHEMA_VERSION = 2  # bump on any change of abi.json's shape (not of its variants)
TARGET_ENV = "vulkan1.1"  # glslangValidator / spirv-val --target-env (shader_build's)
_SCALAR_TYPES = {"uint": "uint32", "float": "float32"}
# specialization constants the GLSL declares ``bool`` (reconstruct.comp): 4 bytes too, VkBool32,
# 0 or 1 — every other one is a ``uint`` (the test holds both against the SPIR-V)
BOOL_SPEC = frozenset({"PIPELINED", "ATOMS_F16", "K_ROPE"})


def _variant_manifest(v: Variant) -> dict:
    optional = dict(v.optional_spec)
    defaults = dict(v.push.defaults)
    if isinstance(v.local, str):
        workgroup = {"x": None, "x_constant_id": v.spec.index(v.local), "x_constant": v.local,
                     "x_default": WG_SIZE, "y": 1, "z": 1}
    else:
        workgroup = {"x": v.local, "x_constant_id": None, "x_constant": None, "x_default": v.local, "y": 1, "z": 1}
    return {
        "name": v.name,
        "spv": f"{v.name}.spv",
        "source": v.source,
        "defines": {k: val for k, val in v.defines},
        "bindings": [{"set": 0, "binding": i, "type": "storage_buffer", "block": b.name,
                      "element_words": b.lanes, "element_bytes": b.lanes * WORD_BYTES,
                      "access": "readwrite" if b.writes else "readonly"}
                     for i, b in enumerate(v.bindings)],
        "push_constants": {
            "struct": v.push.name, "size_bytes": v.push.size_bytes,
            "fields": [{"name": n, "offset": i * WORD_BYTES, "type": _SCALAR_TYPES[t],
                        **({"default": defaults[n]} if n in defaults else {})}
                       for i, (n, t) in enumerate(v.push.fields)]},
        "specialization_constants": [{"constant_id": i, "name": n, "type": "bool" if n in BOOL_SPEC else "uint32",
                                      "size_bytes": WORD_BYTES, "required": n not in optional,
                                      **({"default": optional[n]} if n in optional else {})}
                                     for i, n in enumerate(v.spec)],
        "workgroup_size": workgroup,
        "required_features": {"subgroup_operations": list(v.subgroup_ops), "features": list(v.features),
                              "spirv_capabilities": sorted({c for f in v.features for c in FEATURE_CAPABILITIES[f][0]}),
                              "spirv_extensions": sorted({x for f in v.features for x in FEATURE_CAPABILITIES[f][1]})},
    }


def manifest() -> dict:
    """Every variant's contract as plain JSON data: what an engine in another language needs to
    create its pipeline and record its dispatch (docs/EMBEDDING.md). shader_build writes it
    as ``kvdict_vk/spv/abi.json`` beside the .spv files; tests hold it against their reflection."""
    return {
        "schema": "kvdict_vk.abi",
        "schema_version": ABI_SCHEMA_VERSION,
        "target_env": TARGET_ENV,
        "conventions": {
            "descriptor_set": 0,
            "descriptor_type": "VK_DESCRIPTOR_TYPE_STORAGE_BUFFER",
            "bindings": "set 0, bindings 0..n-1, every one bound; a block's offsets (push fields *_word) "
                        "count 32-bit words into the bound buffer, whatever its element width",
            "access": "readonly: NonWritable in the SPIR-V; readwrite: the shader may write it "
                      "(some are GLSL writeonly): barrier it as written",
            "push_constants": "one 32-bit word per field at its offset, stage COMPUTE; float32 fields "
                              "are IEEE binary32 bits; a field with a default may be left at it",
            "specialization_constants": "4 bytes each (uint32, or bool: VkBool32 0/1); required ones have no usable default; give every "
                                        "constant_id 0..n-1 a VkSpecializationMapEntry",
            "workgroup_size": "x fixed, or set by the constant x_constant_id (local_size_x_id; "
                              "x_default when unspecialized); y = z = 1",
            "required_features": "subgroup_operations: VkSubgroupFeatureFlagBits the device must report "
                                 "for the compute stage; features: other optional device features (enable them at "
                                 "device creation); spirv_capabilities/spirv_extensions: what the module "
                                 "declares for them beyond Shader and the subgroup operations",
        },
        "word_bytes": WORD_BYTES,
        "default_workgroup_x": WG_SIZE,
        "optional_features": list(FEATURES),
        "variants": {name: _variant_manifest(v) for name, v in DECLARATIONS.items()},
    }
