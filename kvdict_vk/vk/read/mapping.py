"""How the read shaders map invocations onto an arena's rows (ReadPlan's pipelines).

CPU drivers ("row" mapping): one invocation per row, its code words read once. GPUs ("chunk"
mapping): reconstruct writes a few 16-byte output chunks of a row per invocation, by the
table below for the stream's sparsity; copy_rows (the f32 cache's read) one chunk.
"""
from __future__ import annotations

# GPUs ("chunk" mapping): how reconstruct maps a stream of s code words per slot, as
# (largest s, (output chunks of a row per invocation, pipelined)) in order, the first entry
# with s <= its bound applying; chunks fall back to 1 where they do not divide the row.
# "Pipelined" loads the next row's slot words early (reconstruct.comp's PIPELINED). More chunks
# per invocation unpack a row's code words in fewer invocations, which pays most where each
# chunk has few gathers (s 1); the early loads hide the slot words' latency until their
# registers cost more than they save (from s 8 on float32 atoms, s 16 on binary16 atoms,
# gathered a quad at a time). The measurements behind both tables: lab/NOTEBOOK.md, heading
# "Reconstruct".
RECONSTRUCT_GPU_MAPPINGS = ((1, (4, False)), (4, (2, True)), (None, (2, False)))
RECONSTRUCT_GPU_MAPPINGS_F16 = ((1, (4, False)), (8, (2, True)), (None, (2, False)))


def vec4_rows(memory) -> bool:
    """Whether rows are read as vec4 (head_dim % 4 == 0) by the read shaders."""
    return memory.layout.head_dim % 4 == 0


def chunks_per_row(memory) -> int:
    """vec4 (or scalar) chunks of a row, as the read shaders see it."""
    return memory.layout.head_dim // (4 if vec4_rows(memory) else 1)


def row_chunks(memory) -> int:
    """copy_rows' CHUNKS (the f32 cache's read): chunks of a row one invocation handles."""
    return chunks_per_row(memory) if memory.shader_mapping == "row" else 1


def reconstruct_mapping(memory, sparsity: int, atoms_f16: bool = False) -> tuple[int, bool]:
    """reconstruct's (CHUNKS, PIPELINED) on the arena ``memory`` (an ArenaMemory: its
    shader_mapping and layout) for a stream of ``sparsity`` code words gathering float32 atoms
    or (``atoms_f16``) binary16 ones: output chunks of a row one invocation writes (a
    whole row on CPU drivers) and whether it loads its next row's slot words early
    (RECONSTRUCT_GPU_MAPPINGS, RECONSTRUCT_GPU_MAPPINGS_F16)."""
    per_row = chunks_per_row(memory)
    if memory.shader_mapping == "row":
        return per_row, False
    table = RECONSTRUCT_GPU_MAPPINGS_F16 if atoms_f16 else RECONSTRUCT_GPU_MAPPINGS
    chunks, pipelined = next(m for bound, m in table if bound is None or sparsity <= bound)
    return (chunks if per_row % chunks == 0 else 1), pipelined
