"""Safetensors files: headers parsed and checked before any tensor data is read.

A truncated or mislabelled file gives a CheckpointError naming the tensor and file
(lily/weights.py then maps the tensors it finds to the model's parameters).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names tensor and file."""


# safetensors dtype -> bytes per element
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: Path) -> dict[str, Entry]:
    """Parse and check one safetensors header without reading tensor data."""
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes is too small for a safetensors file")
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > _MAX_HEADER:
            raise CheckpointError(
                f"{path}: header length {n} runs past the end of the file ({size} bytes): "
                "truncated or not a safetensors file"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header, not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header, not a JSON object")
    data_len = size - 8 - n
    out = {}
    for key, e in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            ok = dtype in _ITEMSIZE and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {key!r}: {e!r}")
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {key!r} data ends at byte {end} but the file holds only "
                f"{data_len} data bytes: the file is truncated"
            )
        if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise CheckpointError(
                f"{path}: tensor {key!r} has {end - begin} bytes for {dtype} shape {list(shape)}"
            )
        out[key] = Entry(path, dtype, shape, end - begin)
    return out


def index_checkpoint(model_dir: str | Path) -> dict[str, Entry]:
    """Every tensor of a (possibly sharded) checkpoint: key -> file, dtype, shape."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: model directory does not exist")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a valid safetensors index") from None
        for name in files:
            if not (d / name).is_file():
                raise CheckpointError(f"{index} names shard {name!r}, which does not exist")
        paths = [d / name for name in files]
    else:
        wmap, paths = None, sorted(d.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(f"{d}: no *.safetensors files in the model directory")
    entries: dict[str, Entry] = {}
    for p in paths:
        for k, e in read_header(p).items():
            if k in entries:
                raise CheckpointError(f"tensor {k!r} is in both {entries[k].file} and {p}")
            entries[k] = e
    for k, name in (wmap or {}).items():
        if k not in entries or entries[k].file.name != name:
            raise CheckpointError(f"{index} puts tensor {k!r} in {name}, which does not hold it")
    return entries
