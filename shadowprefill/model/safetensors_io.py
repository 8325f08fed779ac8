"""Reader and writer of the safetensors file format, in plain Python + torch (no `safetensors` package).

A file is: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
{"dtype": "F32"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]} (plus an optional
"__metadata__" string map), then the raw little-endian tensor bytes; offsets are relative to the end of
the header. Reading memory-maps the file, so a multi-GiB shard is paged in only as tensors are copied out.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Iterator, Mapping

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIGN = 8
_MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    """Lazy view of one .safetensors file: `names()`, `shape(name)`, `get(name)` -> CPU tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > _MAX_HEADER:
                raise ValueError(f"{self.path}: header length {header_len} is implausible; not a safetensors file")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: unreadable safetensors header: {e}") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        file_size = os.path.getsize(self.path)
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
            dtype, shape = DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0 or self._data_start + end > file_size:
                raise ValueError(f"{self.path}: tensor {name!r} has inconsistent data_offsets {[begin, end]} "
                                 f"for shape {list(shape)} {entry['dtype']}")
            self._entries[name] = (dtype, shape, begin, end)
        self._map: mmap.mmap | None = None

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as a CPU tensor backed by the file mapping (copy it before modifying)."""
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        if self._map is None:
            with open(self.path, "rb") as f:
                # ACCESS_COPY: a private, writable mapping, so torch.frombuffer needs no read-only warning.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=self._data_start + begin)
        if (self._data_start + begin) % dtype.itemsize == 0:
            return flat.view(dtype).view(shape)
        return flat.clone().view(dtype).view(shape)  # misaligned data (non-standard writer): copy first

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._entries:
            yield name, self.get(name)


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (any device; stored little-endian, contiguous) to a .safetensors file."""
    entries = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensors[{name!r}] has dtype {tensor.dtype}, which safetensors cannot store")
        entries.append((name, tensor))
    # Largest elements first, so every tensor's offset stays aligned to its element size.
    entries.sort(key=lambda item: (-item[1].dtype.itemsize, item[0]))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, tensor in entries:
        nbytes = tensor.numel() * tensor.dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-(8 + len(header_bytes)) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for _, tensor in entries:
            if tensor.numel():
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(data.numpy().tobytes())
