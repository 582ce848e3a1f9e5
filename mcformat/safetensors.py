"""Minimal safetensors reader/writer on numpy (the format is an 8-byte header size, a JSON header
and raw little-endian tensor bytes). BF16 tensors are handled as raw uint16 words.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32, "I64": np.int64}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """The file is not valid safetensors (truncated, corrupt header, unknown dtype)."""


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 words."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def write(path: str | Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Write {name: (dtype, array)} to `path` atomically (temp file, fsync, rename)."""
    header, offset = {}, 0
    for name, (dtype, arr) in tensors.items():
        nbytes = arr.nbytes
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data section). Raises SafetensorsError."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: truncated (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise SafetensorsError(f"{path}: header size {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsError(f"{path}: corrupt header ({exc})") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise SafetensorsError(f"{path}: truncated: tensors need {8 + n + end} bytes, file has {size}")
    return header, 8 + n


def read(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (dtype, array)}; arrays are read-only memory maps of the file."""
    header, base = read_header(path)
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        arr = mm[base + start : base + end].view(DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr)
    return out
