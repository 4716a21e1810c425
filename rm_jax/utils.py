"""Small shared helpers: content hashes and package versions for manifests."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os

MANIFEST_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "array-record",
                     "transformers", "tokenizers", "safetensors", "numpy", "pillow", "tokamax")


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_sha256(root: str) -> str:
    """Hash of every file under `root` (names and bytes), in sorted order."""
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            h.update(file_sha256(path).encode())
    return h.hexdigest()


def package_versions(names=MANIFEST_PACKAGES) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
