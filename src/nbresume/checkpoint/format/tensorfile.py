"""Reading and writing safetensors files without pickle and without a second copy.

nbresume writes the standard safetensors layout itself (an 8-byte little-endian header length,
a JSON header, then the raw tensor bytes) so that it can stream each tensor's memory straight
to the file while hashing it: the SHA-256 recorded in the manifest costs no extra pass. The
official ``safetensors`` library opens these files (a test proves it).

The reader checks a file as if a stranger wrote it: the header must be well-formed, every
tensor's bytes must lie inside the file, tensors must tile the data area without gaps or
overlaps, and only known dtypes are accepted. Nothing in a file can make it run code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from nbresume.errors import CheckpointError, CorruptCheckpointError

#: Largest safetensors header nbresume writes or reads (the official library allows 100 MB).
#: A header is parsed, to refuse a file that claims more bytes than its tensors hold before
#: those are read, and parsing JSON takes some twenty times its size: 16 MiB (some 150 000
#: tensors in one file) keeps that under half a gigabyte.
MAX_HEADER_BYTES = 16 << 20
#: Most dimensions a tensor may have (NumPy builds no more than 64).
MAX_DIMS = 64
_ALIGN = 8

# safetensors dtype name -> (itemsize, torch dtype attribute, numpy dtype or None)
_DTYPES: dict[str, tuple[int, str, str | None]] = {
    "BOOL": (1, "bool", "bool"),
    "U8": (1, "uint8", "uint8"),
    "I8": (1, "int8", "int8"),
    "I16": (2, "int16", "<i2"),
    "U16": (2, "uint16", "<u2"),
    "F16": (2, "float16", "<f2"),
    "BF16": (2, "bfloat16", None),
    "I32": (4, "int32", "<i4"),
    "U32": (4, "uint32", "<u4"),
    "F32": (4, "float32", "<f4"),
    "I64": (8, "int64", "<i8"),
    "U64": (8, "uint64", "<u8"),
    "F64": (8, "float64", "<f8"),
    "F8_E4M3": (1, "float8_e4m3fn", None),
    "F8_E5M2": (1, "float8_e5m2", None),
}
_TORCH_NAME_TO_ST = {torch_name: st for st, (_, torch_name, _) in _DTYPES.items()}
_NUMPY_KIND_TO_ST = {
    ("b", 1): "BOOL", ("u", 1): "U8", ("i", 1): "I8", ("i", 2): "I16", ("u", 2): "U16",
    ("f", 2): "F16", ("i", 4): "I32", ("u", 4): "U32", ("f", 4): "F32", ("i", 8): "I64",
    ("u", 8): "U64", ("f", 8): "F64",
}  # fmt: skip


@dataclass(frozen=True)
class RawTensor:
    """A tensor reduced to what the file needs: dtype name, shape and its bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # contiguous, little-endian, exactly itemsize * numel bytes

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def to_raw(value: Any, *, name: str) -> RawTensor:
    """Reduce a torch tensor or NumPy array to a :class:`RawTensor` (a view, not a copy, when
    the tensor is already contiguous and in host memory)."""
    module = type(value).__module__
    if module.startswith("torch"):
        return _torch_to_raw(value, name)
    if module.startswith("numpy"):
        return _numpy_to_raw(value, name)
    raise TypeError(
        f"tensor {name!r} is a {type(value).__name__}; nbresume stores torch tensors and "
        "NumPy arrays in safetensors files (put other values in the JSON state)"
    )


def _torch_to_raw(tensor: Any, name: str) -> RawTensor:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    st_dtype = _TORCH_NAME_TO_ST.get(dtype_name)
    if st_dtype is None:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg()
    data = memoryview(flat.view(torch.uint8).numpy().data) if flat.numel() else memoryview(b"")
    return RawTensor(st_dtype, tuple(int(d) for d in tensor.shape), data)


@dataclass(frozen=True)
class StagedTensor:
    """A tensor outside host memory whose bytes come piece by piece as the file is written
    (each piece valid until the next is asked for), never copied to the host whole."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    pieces: Callable[[], Iterable[memoryview]]


def _staged(tensor: Any, name: str, stage: Callable[[Any], Iterable[memoryview]]) -> StagedTensor:
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    st_dtype = _TORCH_NAME_TO_ST.get(dtype_name)
    if st_dtype is None:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
    nbytes = tensor.numel() * tensor.element_size()
    return StagedTensor(
        st_dtype, tuple(int(d) for d in tensor.shape), nbytes, lambda: stage(tensor)
    )


def _outside_host(value: Any) -> bool:
    """A torch tensor that is not in host memory (on a GPU)."""
    device = getattr(value, "device", None)
    return type(value).__module__.startswith("torch") and getattr(device, "type", "cpu") != "cpu"


def _numpy_to_raw(array: Any, name: str) -> RawTensor:
    import numpy as np

    array = np.asarray(array)
    st_dtype = _NUMPY_KIND_TO_ST.get((array.dtype.kind, array.dtype.itemsize))
    if st_dtype is None:
        raise TypeError(f"array {name!r} has dtype {array.dtype}, which safetensors cannot hold")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(array).reshape(-1)
    return RawTensor(st_dtype, tuple(int(d) for d in array.shape), flat.view(np.uint8).data)


def torch_name(dtype: str) -> str:
    """The torch name of the safetensors dtype ``dtype`` (``F32``: ``float32``)."""
    return _DTYPES[dtype][1] if dtype in _DTYPES else dtype


def from_torch_name(name: str) -> tuple[str, int] | None:
    """The safetensors dtype of the torch dtype named ``name`` (``float32``: ``F32``) and its
    bytes per element; ``None`` for a dtype safetensors cannot hold."""
    st_dtype = _TORCH_NAME_TO_ST.get(name)
    return None if st_dtype is None else (st_dtype, _DTYPES[st_dtype][0])


def signature(value: Any) -> tuple[str, tuple[int, ...]] | None:
    """The safetensors dtype name and the shape of a torch tensor, a NumPy array or a
    :class:`TensorSpec` (``None`` for anything else, or a dtype safetensors cannot hold)."""
    if isinstance(value, TensorSpec):
        return value.dtype, value.shape
    module = type(value).__module__
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    if module.startswith("torch"):
        name = _TORCH_NAME_TO_ST.get(str(dtype).removeprefix("torch."))
    elif module.startswith("numpy"):
        name = _NUMPY_KIND_TO_ST.get((dtype.kind, dtype.itemsize))
    else:
        return None
    return None if name is None else (name, tuple(int(d) for d in shape))


@dataclass(frozen=True)
class EncodedFile:
    """A safetensors file ready to stream: its header bytes and the tensor buffers in order."""

    header: bytes
    tensors: tuple[RawTensor | StagedTensor, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    @property
    def staged(self) -> bool:
        """Whether some of its bytes come piece by piece (:class:`StagedTensor`): the file
        must then be written from :meth:`chunks` as they come, each before the next."""
        return any(isinstance(t, StagedTensor) for t in self.tensors)

    def chunks(self) -> Iterator[memoryview | bytes]:
        yield self.header
        for tensor in self.tensors:
            if not tensor.nbytes:
                continue
            if isinstance(tensor, StagedTensor):
                yield from tensor.pieces()
            else:
                yield tensor.data


def encode(
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    stage: Callable[[Any], Iterable[memoryview]] | None = None,
) -> EncodedFile:
    """Lay out ``tensors`` as a safetensors file (header and buffers, nothing copied).

    A tensor outside host memory (on a GPU) is copied to the host whole, unless ``stage`` is
    given: its bytes then come from ``stage(tensor)``, piece by piece, as the file is written
    (:attr:`EncodedFile.staged`). The file's bytes are the same either way."""
    raws: dict[str, RawTensor | StagedTensor] = {
        name: _staged(value, name, stage)
        if stage is not None and _outside_host(value)
        else to_raw(value, name=name)
        for name, value in tensors.items()
    }
    # Largest items first, then by name, as the official writer does: with the data area
    # starting 8-aligned, every tensor then starts aligned to its own item size.
    order = sorted(raws, key=lambda n: (-_DTYPES[raws[n].dtype][0], n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        raw = raws[name]
        header[name] = {
            "dtype": raw.dtype,
            "shape": list(raw.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    if len(text) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"the header of {len(raws)} tensors is {len(text)} bytes, more than the "
            f"{MAX_HEADER_BYTES} a checkpoint's safetensors file may have",
            fix="save fewer, larger tensors in one file (split the state over several names)",
        )
    prefix = len(text).to_bytes(8, "little")
    return EncodedFile(prefix + text, tuple(raws[name] for name in order))


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def header_length(prefix: bytes | bytearray | memoryview, total: int, *, where: str) -> int:
    """The byte count of the header that follows the first 8 bytes (``prefix``) of a
    safetensors file of ``total`` bytes, checked to fit in the file before anything is read."""
    if total < 8 or len(prefix) < 8:
        raise CorruptCheckpointError(
            f"not a valid safetensors file: {total} bytes is too short for a header", where=where
        )
    header_len = int.from_bytes(bytes(prefix[:8]), "little")
    if header_len > MAX_HEADER_BYTES or 8 + header_len > total:
        raise CorruptCheckpointError(
            f"not a valid safetensors file: header length {header_len} does not fit in a "
            f"file of {total} bytes",
            where=where,
        )
    return header_len


def parse_header(
    buffer: bytes | bytearray | memoryview, *, where: str, total: int | None = None
) -> tuple[int, dict[str, TensorSpec], dict[str, str]]:
    """Validate a safetensors file held in ``buffer``.

    With ``total`` (the file's size), ``buffer`` may hold only the start of the file, up to
    the end of its header: the header is then checked against a file of that size before
    the tensor bytes are read (a file that claims more bytes than its tensors account for is
    refused without reading them).

    Returns the offset of the data area, the tensor specs and the metadata. Raises
    :class:`CorruptCheckpointError` naming ``where`` for anything malformed.
    """

    def bad(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"not a valid safetensors file: {reason}", where=where)

    total = len(buffer) if total is None else total
    header_len = header_length(buffer, total, where=where)
    if 8 + header_len > len(buffer):
        raise bad(f"the header is cut short ({len(buffer)} of {8 + header_len} bytes)")
    try:
        header = json.loads(bytes(buffer[8 : 8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    metadata_raw = header.pop("__metadata__", {})
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise bad("__metadata__ is not an object of strings")
    data_start = 8 + header_len
    data_len = total - data_start
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(_is_count(d) for d in shape)
        ):
            raise bad(f"tensor {name!r} has an invalid shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]
            or offsets[1] > data_len
        ):
            raise bad(f"tensor {name!r} has data offsets outside the file")
        if math.prod(shape) * _DTYPES[dtype][0] != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: its shape and dtype do not match its byte range")
        specs[name] = TensorSpec(dtype, tuple(shape), offsets[0], offsets[1])
    position = 0
    for spec in sorted(specs.values(), key=lambda s: (s.start, s.end)):
        if spec.start != position:
            raise bad("tensor byte ranges overlap or leave gaps")
        position = spec.end
    if position != data_len:
        raise bad(f"{data_len - position} bytes after the last tensor")
    return data_start, specs, dict(metadata_raw)


def decode(
    buffer: bytearray | memoryview, *, where: str, framework: str = "torch"
) -> dict[str, Any]:
    """Tensors of a safetensors file held in ``buffer`` (shared with it, not copied)."""
    if framework not in ("torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    data_start, specs, _ = parse_header(buffer, where=where)
    try:
        return _decode(buffer, data_start, specs, where, framework)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise _unbuildable(exc, where) from None


def decode_specs(
    buffer: bytearray | memoryview, specs: Mapping[str, TensorSpec], *, where: str
) -> dict[str, Any]:
    """Torch tensors on ``buffer`` where ``specs`` place them (their ranges counted from the
    buffer's start, already checked): a file's tensors read into memory other than the
    whole file's."""
    try:
        return _decode(buffer, 0, specs, where, "torch")
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise _unbuildable(exc, where) from None


def _decode(
    buffer: bytearray | memoryview,
    data_start: int,
    specs: Mapping[str, TensorSpec],
    where: str,
    framework: str,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if framework == "torch":
        import torch

        for name, spec in specs.items():
            dtype = getattr(torch, _DTYPES[spec.dtype][1])
            count = (spec.end - spec.start) // _DTYPES[spec.dtype][0]
            if count == 0:
                out[name] = torch.empty(spec.shape, dtype=dtype)
            else:
                flat = torch.frombuffer(
                    buffer, dtype=dtype, count=count, offset=data_start + spec.start
                )
                out[name] = flat.reshape(spec.shape)
    else:
        import numpy as np

        for name, spec in specs.items():
            np_dtype = _DTYPES[spec.dtype][2]
            if np_dtype is None:
                # Not corruption: the file is fine, the caller asked for the wrong framework
                # (raising CorruptCheckpointError would make load() fall back to older steps).
                raise CheckpointError(
                    f"tensor {name!r} has dtype {spec.dtype}, which NumPy cannot hold",
                    where=where,
                    fix="load it with framework='torch'",
                )
            count = (spec.end - spec.start) // _DTYPES[spec.dtype][0]
            out[name] = np.frombuffer(
                buffer, dtype=np_dtype, count=count, offset=data_start + spec.start
            ).reshape(spec.shape)
    return out


def is_device_bytes(buffer: object) -> bool:
    """Whether ``buffer`` is a file's bytes held in a torch byte tensor (on a device)."""
    return type(buffer).__module__.startswith("torch")


def decode_device(data: Any, *, where: str) -> dict[str, Any]:
    """Tensors of a safetensors file held in ``data``, a byte tensor on a device: views of
    it where a tensor's offset suits its dtype (the official layout: always), copies where
    it does not. A tensor of one element or none (an optimizer's step count) is put in host
    memory, where a file read into host memory gives it: where such a scalar lives changes
    what an optimizer does with it."""
    import torch

    total = int(data.numel())
    prefix = bytes(data[:8].cpu().numpy()) if total >= 8 else b""
    end = 8 + header_length(prefix, total, where=where)
    data_start, specs, _ = parse_header(bytes(data[:end].cpu().numpy()), where=where, total=total)
    out: dict[str, Any] = {}
    try:
        for name, spec in specs.items():
            dtype = getattr(torch, _DTYPES[spec.dtype][1])
            start = data_start + spec.start
            raw = data[start : data_start + spec.end]
            if start % _DTYPES[spec.dtype][0]:
                raw = raw.clone()  # a stranger's file: not aligned to its item size
            if math.prod(spec.shape) <= 1:
                raw = raw.cpu()
            out[name] = raw.view(dtype).reshape(spec.shape)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise _unbuildable(exc, where) from None
    return out


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unbuildable(exc: BaseException, where: str) -> CorruptCheckpointError:
    """The error for a shape the header allows but the framework cannot build (a zero-sized
    tensor with a dimension beyond 2**63, more dimensions than NumPy supports). torch appends
    a C++ stack to its messages: the first line is kept."""
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return CorruptCheckpointError(
        f"not a valid safetensors file: a tensor's shape cannot be built ({reason})",
        where=where,
    )
