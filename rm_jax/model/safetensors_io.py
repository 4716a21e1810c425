"""safetensors read and written without torch (bf16 through ml_dtypes), and a checkpoint dir's
file list.

Design choices:

* **Memory.** Headers are parsed eagerly and each file is one read-only memory map: tensors are
  zero-copy views, so the converter transforms one tensor at a time on the host.
* **Only safetensors are read.** Pickle ``.bin``/``.pt`` checkpoints execute code on load; they
  are refused by name.
* Nothing here knows a parameter name: the key tables are per architecture
  (``rm_jax.model.<arch>.params``) and the engine that applies them is ``rm_jax.model.hf_checkpoint``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint we cannot (or must not) load; the message names the file and key."""


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class SafetensorsFile:
    """Header parsed eagerly; tensors are zero-copy views of one read-only memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", {})
        self.header = header
        self._base = 8 + n
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        for key, info in header.items():
            start, end = info["data_offsets"]
            want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
            if end - start != want or self._base + end > self._mm.size:
                raise CheckpointError(f"{self.path}: tensor {key} ({info['dtype']} {info['shape']}) needs bytes "
                                      f"[{self._base + start}, {self._base + end}) but the file has "
                                      f"{self._mm.size}: truncated or corrupt safetensors file")

    def keys(self):
        return list(self.header)

    def shape(self, key):
        return tuple(self.header[key]["shape"])

    def get(self, key) -> np.ndarray:
        info = self.header[key]
        start, end = info["data_offsets"]
        raw = self._mm[self._base + start:self._base + end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_safetensors(path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    return {k: np.array(f.get(k)) for k in f.keys()}


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    header, offset = {}, 0
    arrays = []
    for key in tensors:
        a = np.ascontiguousarray(tensors[key])
        header[key] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                       "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)     # no bytes copy: a shard stays one shard in memory


def checkpoint_files(hf_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint dir; refuses pickle checkpoints by name."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    index = d / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise CheckpointError(
                f"{d / pickles[0]}: pickle checkpoints (.bin/.pt) are refused because loading them "
                "runs arbitrary code; convert to safetensors first (e.g. transformers "
                "`model.save_pretrained(dir, safe_serialization=True)`)")
        raise CheckpointError(f"{d}: no *.safetensors files found")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
    return files
