"""Every error kvdict_vk raises on purpose: one base class, one subclass per failure.

Callers catch :class:`KvDictError` to handle "anything this library refused"; tests and
tools catch the precise subclass. Messages always say what was wrong and, where it
helps, what was expected. Loading and installing are all-or-nothing: when one of these
is raised, the previously installed state is exactly as it was.
"""
from __future__ import annotations


class KvDictError(Exception):
    """Base class of every error kvdict_vk raises deliberately."""


# --- artifact loading (fail-closed) -------------------------------------------------

class ArtifactError(KvDictError):
    """The artifact was refused; nothing was installed."""


class ArtifactIOError(ArtifactError):
    """The file could not be read (missing, unreadable, not a regular file)."""


class FrameError(ArtifactError):
    """The fixed binary frame is wrong: magic, frame version, flags, lengths, CRC."""


class SizeLimitError(ArtifactError):
    """A declared or actual size exceeds a limit; refused before allocating."""


class HeaderError(ArtifactError):
    """The CBOR provenance header is malformed or misses a required field."""


class WrongKindError(ArtifactError):
    """The artifact is not a KV dictionary (header kind != 'KvDictionary')."""


class NotCertifiedError(ArtifactError):
    """The artifact did not pass its certification gate (passed != true)."""


class UncertifiedError(NotCertifiedError):
    """Dictionaries without a certificate were offered to the runtime (install, enable,
    enabled_with, install_from_cbor) without ``allow_uncertified=True``; nothing changed."""


class PayloadLengthError(ArtifactError):
    """The payload's length differs from the one the header declares."""


class PayloadHashError(ArtifactError):
    """The payload's SHA-256 differs from the one the header declares."""


class CborError(ArtifactError):
    """The payload or header is not well-formed CBOR within our limits (depth,
    duplicate keys, trailing bytes, lengths beyond the data)."""


class SchemaError(ArtifactError):
    """The payload decodes but does not follow the KvDictArtifact schema."""


class FormatVersionError(SchemaError):
    """The payload's format_version is one this reader does not read (older or newer); an
    older artifact is forged again (docs/FORMAT.md, "Versioning")."""


class TypedArrayError(SchemaError):
    """An array is not an RFC 8746 little-endian float32 typed array of the right shape."""


class DimsError(SchemaError):
    """Dimensions disagree (atoms vs head_dim, header vs payload, layer count, ...)."""


class NonFiniteError(SchemaError):
    """An array holds NaN or Inf."""


class ZeroAtomError(SchemaError):
    """A dictionary holds an all-zero atom (it could never be selected meaningfully)."""


# --- runtime / codec ------------------------------------------------------------------

class ShapeError(KvDictError, ValueError):
    """An input array has the wrong shape, dtype or layout."""


class LayerIndexError(KvDictError, IndexError):
    """A layer index is out of range."""


class CodeWordError(KvDictError, ValueError):
    """A code word is invalid (atom index >= n_atoms, non-finite coefficient)."""


# --- GPU side -------------------------------------------------------------------------

class VulkanError(KvDictError):
    """Kompute or the Vulkan driver failed; the message names the device."""


class DeviceNotFoundError(VulkanError):
    """No Vulkan device, or none matching the requested index/name."""


class ArenaError(KvDictError):
    """An arena request is invalid (token range beyond n_ctx, freed arena, ...)."""


class ArenaTooLargeError(ArenaError):
    """The arena would exceed the device's limits or memory; refused before allocating."""


class DispatchError(VulkanError):
    """A dispatch's buffers, sizes or push constants do not match its shader."""


class ShaderBuildError(KvDictError):
    """glslangValidator or spirv-val reported a problem (any stderr output counts)."""


class DistributedError(ArenaError):
    """A split over torch.distributed ranks cannot run: torch (the ``distributed`` extra) is
    absent, no process group is initialised, or the ranks' calls disagree."""


class DictMismatchError(ArenaError):
    """The active dictionary does not fit the arena's model dims (n_layers, head_dim,
    n_atoms, per-stream sparsity); refused before anything is allocated."""


# --- benchmarks -----------------------------------------------------------------------

class AnchorError(KvDictError):
    """An outside program a benchmark compares against (llama.cpp's test-backend-ops) is
    missing, failed, or printed what was not expected; the message quotes it."""
