"""The files of a checkpoint directory: config.json, ``model.safetensors`` or
``model.safetensors.index.json`` and its shards, opened and read with every failure a ValueError
naming the file.

The index must be a JSON object with a ``weight_map`` object of tensor name -> shard file name
(strings); every shard, named by the index or found, must lie inside the checkpoint directory (no
absolute path, no ``..``, no symlink resolving outside it; the one exception is the Hugging Face hub
cache, whose ``snapshots/<rev>/`` files link to the same repository's ``blobs/``) and be a readable
safetensors file (a truncated, empty or foreign file names its path).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64", "BOOL": "bool"}


def dtype_name(dtype: str) -> str:
    """A safetensors header's dtype ("BF16") by torch's name ("bfloat16")."""
    return _SAFETENSORS_DTYPES.get(dtype, dtype)


def read_json_object(path: str, what: str = "config.json") -> dict:
    """The JSON object in file ``path``: a missing or unreadable file, text that is not JSON, or JSON
    that is not an object is one ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no {what}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got a JSON {_json_kind(value)}")
    return value


def _json_kind(value) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"


@contextmanager
def open_safetensors(file: str):
    """``safe_open(file)``: any failure to open it (missing, empty, truncated, not safetensors) is a
    ValueError naming the file."""
    from safetensors import safe_open

    try:
        f = safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError, OSError, ...
        raise ValueError(f"cannot open {file} as safetensors: {e}") from e
    with f:
        yield f


def read_tensor(f, file: str, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"cannot read tensor {name} from {file}: {e}") from e


def headers(file: str) -> dict[str, tuple[list, str]]:
    """Tensor name -> (shape, safetensors dtype) of one file, from its header."""
    with open_safetensors(file) as f:
        try:
            out = {}
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (list(piece.get_shape()), piece.get_dtype())
            return out
        except Exception as e:
            raise ValueError(f"cannot read the header of {file}: {e}") from e


def _shard(path: str, name: str, index: str | None, entry: str | None = None) -> str:
    """The file ``name`` of checkpoint directory ``path`` (named by ``index``'s ``weight_map[entry]``), refused
    unless it lies inside it; every error names the index, the entry and the shard."""
    where = f"{index}: weight_map[{entry!r}] names shard {name!r}" if index else f"{name!r}"
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or ".." in parts or not name or name in (".",):
        raise ValueError(f"{where}: shard files must lie inside the checkpoint directory {path} "
                         "(a file name relative to it, without '..')")
    if "\0" in name:  # the OS would refuse it with a bare "embedded null byte"
        raise ValueError(f"{where}: a file name cannot hold a NUL character")
    full = os.path.join(path, name)
    try:
        root, real = os.path.realpath(path), os.path.realpath(full)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot resolve {full}: {e}") from e
    if os.path.commonpath([root, real]) != root and not _in_hub_blobs(root, real):
        raise ValueError(f"{where}: {full} resolves to {real}, outside the checkpoint directory {root}")
    if not os.path.isfile(full):
        raise ValueError(f"{where}: {full} " + ("is not a file" if os.path.exists(full) else "does not exist"))
    return full


def _in_hub_blobs(root: str, real: str) -> bool:
    """The Hugging Face hub cache: ``<repo>/snapshots/<rev>/<file>`` links to ``<repo>/blobs/<hash>``."""
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) != "snapshots":
        return False
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return os.path.dirname(real) == blobs


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint directory (the index checked, every shard inside
    the directory; tensor names of a single file from its header)."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        raw = read_json_object(index, "the index")
        weight_map = raw.get("weight_map")
        if weight_map is None:
            raise ValueError(f"the index {index} has no 'weight_map' (tensor name -> shard file)")
        if not isinstance(weight_map, dict):
            raise ValueError(f"the index {index}: 'weight_map' must be an object of tensor name -> shard file, "
                             f"got {type(weight_map).__name__}")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise ValueError(f"the index {index}: weight_map[{name!r}] must be a shard file name (a string), "
                                 f"got {file!r}")
        first_entry = {}  # each shard's first tensor in the index, named in its errors
        for name, file in weight_map.items():
            first_entry.setdefault(file, name)
        shards = {file: _shard(path, file, index, first_entry[file]) for file in sorted(first_entry)}
        return {name: shards[file] for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE)
    if not os.path.lexists(single):
        raise ValueError(f"{path} has neither {SINGLE} nor {INDEX}")
    single = _shard(path, SINGLE, None)
    return {name: single for name in headers(single)}
