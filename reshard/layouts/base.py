"""What every layout provides: an opened source (canonical view) and target file specs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from reshard.core.canonical import CanonicalModel
from reshard.core.pieces import StoredTensor
from reshard.errors import CheckpointError
from reshard.io.tensorfile import TensorFile

# Non-weight files that travel with a checkpoint (tokenizer, generation config).
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json",
)


@dataclass
class Options:
    """Conversion options shared by all layouts."""

    tp: int = 1
    pp: int = 1
    dtype: str | None = None  # safetensors dtype name of the output, None keeps the source's
    megatron_spec: str = "te"
    max_shard_size: int = 5 * 10**9
    vocab_size: int | None = None  # the true vocab, when a Megatron source does not record it
    vocab_divisor: int | None = None  # Megatron make_vocab_size_divisible_by (default: source's, else 128)
    architecture: str | None = None  # HF architecture for a Megatron source without one recorded
    mapping: str | None = None  # a user's mapping file
    allow_replica_mismatch: bool = False


@dataclass
class Source:
    """An opened checkpoint: its canonical model and where every canonical row range lives."""

    layout: str
    root: str
    model: CanonicalModel
    files: list[TensorFile]
    stored: list[tuple[int, StoredTensor]]
    degrees: dict[str, int]
    info: dict[str, Any] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)  # absolute paths of tokenizer etc. to carry along

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def row_bytes(self, source: int, tensor: str, axis: int) -> int:
        loc = self.files[source].tensors[tensor]
        n = loc.nbytes
        return n // loc.shape[axis] if loc.shape and loc.shape[axis] else n


@dataclass
class TargetSpec:
    """A file a target layout will write: its tensors as pieces, plus a torch payload or safetensors metadata."""

    path: str
    format: str
    tensors: list[StoredTensor]
    payload: Any = None
    metadata: dict | None = None


def stored_dtype(model: CanonicalModel, tensor: StoredTensor, opts: Options, default: str) -> str:
    """The dtype a target tensor is written in: its own fixed dtype (constants), else --dtype, else the dtype of
    the source tensor it comes from (``default`` for one without a canonical source)."""
    canon = next((p.canonical for p in tensor.pieces if p.canonical), None)
    return tensor.dtype or opts.dtype or model.dtypes.get(canon, default)


def pack_by_size(tensors: list, nbytes_of, limit: int) -> list[list]:
    """Consecutive ``tensors`` grouped into files of at most ``limit`` bytes (HF shards, vLLM parts); a tensor
    larger than ``limit`` gets a file of its own."""
    files: list[list] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = nbytes_of(tensor)
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += nbytes
    return files


def find_side_files(folder: str) -> list[str]:
    return [os.path.join(folder, n) for n in SIDE_FILES if os.path.isfile(os.path.join(folder, n))]


def check_shape(where: str, name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise CheckpointError(f"{where}: tensor '{name}' has shape {list(actual)} but the config implies "
                              f"{list(expected)}: the config does not match the weights")
