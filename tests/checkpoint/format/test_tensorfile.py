"""Our safetensors writer and reader: exact round trips, and interchange with the official
``safetensors`` library in both directions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

from nbresume.checkpoint.format import tensorfile
from nbresume.errors import CheckpointError, CorruptCheckpointError

ALL_TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor whose bytes are random: NaNs with payloads, -0.0, subnormals and all."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape, dtype=np.int64))
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor's values in row-major order (compares NaNs exactly)."""
    flat = tensor.detach().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


def file_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    encoded = tensorfile.encode(tensors, metadata)
    data = b"".join(bytes(chunk) for chunk in encoded.chunks())
    assert len(data) == encoded.size
    return data


def sample_tensors() -> dict[str, torch.Tensor]:
    base = random_bits((6, 4), torch.float32, seed=1)
    tensors = {f"x.{str(d).removeprefix('torch.')}": random_bits((3, 5), d, seed=i)
               for i, d in enumerate(ALL_TORCH_DTYPES)}  # fmt: skip
    tensors.update(
        {
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 3, dtype=torch.bfloat16),
            "empty_inner": torch.empty(2, 0, dtype=torch.int64),
            "transposed": base.t(),
            "strided": base[::2, 1::2],
            "expanded": torch.arange(3.0).expand(4, 3),
            "channels_last": random_bits((2, 3, 4, 5), torch.float16).to(
                memory_format=torch.channels_last
            ),
            "needs_grad": torch.ones(3, requires_grad=True),
            "negative_view": torch._neg_view(torch.arange(4.0)),
        }
    )
    return tensors


def test_every_dtype_and_layout_round_trips_bit_for_bit() -> None:
    tensors = sample_tensors()
    data = bytearray(file_bytes(tensors))
    loaded = tensorfile.decode(data, where="x")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert_same(loaded[name], tensor)
        assert not loaded[name].requires_grad


def test_numpy_arrays_round_trip_in_both_frameworks() -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal(5).astype(np.float16),
        "i64": rng.integers(-(2**62), 2**62, size=7),
        "u8": rng.integers(0, 255, size=(2, 2), dtype=np.uint8),
        "flags": rng.integers(0, 2, size=6).astype(bool),
        "big_endian": np.arange(6, dtype=">f8").reshape(2, 3),
        "fortran": np.asfortranarray(rng.standard_normal((3, 2))),
        "scalar": np.array(7, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "numpy_scalar": np.float32(1.25),
    }
    data = file_bytes(arrays)
    as_numpy = tensorfile.decode(bytearray(data), where="x", framework="numpy")
    as_torch = tensorfile.decode(bytearray(data), where="x", framework="torch")
    for name, value in arrays.items():
        array = np.asarray(value)
        got = as_numpy[name]
        assert got.shape == array.shape
        assert got.dtype == array.dtype.newbyteorder("<")
        np.testing.assert_array_equal(got, array)
        np.testing.assert_array_equal(as_torch[name].numpy(), array)


def test_the_official_library_reads_our_files(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "ours.safetensors"
    path.write_bytes(file_bytes(tensors, metadata={"written_by": "nbresume"}))

    official = safetensors.torch.load_file(str(path))
    assert set(official) == set(tensors)
    for name, tensor in tensors.items():
        assert_same(official[name], tensor)
    with safetensors.safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"written_by": "nbresume"}
        assert_same(handle.get_tensor("strided"), tensors["strided"])


def test_the_official_numpy_reader_reads_our_files(tmp_path: Path) -> None:
    arrays = {
        "a": np.arange(12, dtype=np.float64).reshape(3, 4),
        "b": np.array([True, False]),
        "c": np.arange(5, dtype=np.int16),
    }
    path = tmp_path / "ours.safetensors"
    path.write_bytes(file_bytes(arrays))
    official = safetensors.numpy.load_file(str(path))
    for name, array in arrays.items():
        np.testing.assert_array_equal(official[name], array)
        assert official[name].dtype == array.dtype


def test_we_read_files_the_official_library_wrote(tmp_path: Path) -> None:
    # The official writer wants plain contiguous tensors.
    tensors = {k: v.detach().resolve_neg().contiguous() for k, v in sample_tensors().items()}
    path = tmp_path / "official.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"epoch": "3"})

    buffer = bytearray(path.read_bytes())
    _, specs, metadata = tensorfile.parse_header(buffer, where=str(path))
    assert metadata == {"epoch": "3"}
    assert set(specs) == set(tensors)
    loaded = tensorfile.decode(buffer, where=str(path))
    for name, tensor in tensors.items():
        assert_same(loaded[name], tensor)

    arrays: dict[str, np.ndarray] = {
        "x": np.linspace(0, 1, 7, dtype=np.float32),
        "y": np.arange(3, dtype=np.uint64),
    }
    safetensors.numpy.save_file(arrays, str(tmp_path / "np.safetensors"))
    got = tensorfile.decode(
        bytearray((tmp_path / "np.safetensors").read_bytes()), where="np", framework="numpy"
    )
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
        assert got[name].dtype == array.dtype


def test_every_tensor_starts_aligned_to_its_item_size() -> None:
    # Aligned data is what lets a reader map the file and view tensors without copying.
    tensors = {
        "odd_bytes": torch.ones(3, dtype=torch.uint8),
        "f64": torch.ones(5, dtype=torch.float64),
        "f16": torch.ones(3, dtype=torch.float16),
        "i32": torch.ones(1, dtype=torch.int32),
        "b": torch.ones(1, dtype=torch.bool),
    }
    data = file_bytes(tensors, metadata={"k": "odd length"})
    data_start, specs, _ = tensorfile.parse_header(data, where="x")
    for name, spec in specs.items():
        assert (data_start + spec.start) % tensors[name].element_size() == 0, name


def test_the_header_is_the_standard_layout() -> None:
    data = file_bytes({"w": torch.arange(4, dtype=torch.int32)})
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    assert header == {"w": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}}
    assert data[8 + length :] == np.arange(4, dtype="<i4").tobytes()


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(2, dtype=torch.complex64),
        np.zeros(2, dtype=np.complex128),
        np.array(["a", "b"], dtype=object),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        [1.0, 2.0],
        3.5,
    ],
    ids=["torch-complex", "numpy-complex", "numpy-object", "numpy-datetime", "list", "float"],
)
def test_what_safetensors_cannot_hold_is_refused_by_name(value: Any) -> None:
    with pytest.raises(TypeError, match="'bad'"):
        tensorfile.encode({"bad": value})


def test_bfloat16_asked_for_as_numpy_is_a_usage_error_not_corruption() -> None:
    data = bytearray(file_bytes({"w": torch.ones(2, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match="framework='torch'") as caught:
        tensorfile.decode(data, where="w.safetensors", framework="numpy")
    assert not isinstance(caught.value, CorruptCheckpointError)


def test_an_unknown_framework_is_refused() -> None:
    data = bytearray(file_bytes({"w": torch.ones(2)}))
    with pytest.raises(ValueError, match="jax"):
        tensorfile.decode(data, where="w", framework="jax")
