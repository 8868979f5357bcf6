"""One tensor-parallel rank's weights read a piece at a time, for a forward pass that holds one layer at once.

A layout's ``rank_loader`` names a :class:`RankStream` subclass, called as ``cls(path, rank, world, opts,
metered=False)``: the constructor opens the rank's own files and reads headers only; :meth:`RankStream.embedding`,
:meth:`RankStream.layer` and :meth:`RankStream.head` then read just those tensors, in the stored dtype, from the
same files the whole-rank loader read. :meth:`RankStream.load_all` gives the whole rank at once
(:class:`~reshard.verification.forward.rank_weights.RankWeights`).

``metered=True`` reads nothing: every read returns a ``meta`` tensor of the slice's shape and dtype and adds the
slice's bytes to :attr:`RankStream.bytes_read` (the forward check's dry-run estimate runs the same reading code).

A stream's files are wrapped (:meth:`RankStream.staged`) so that, once :attr:`RankStream.stager` is set (a GPU
rank: :mod:`.staging`), every read lands on the compute device through bounded host buffers instead of in host
memory; with no stager (the default) reads are the files' own.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from reshard.io import dtypes
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights, RankWeights
from reshard.verification.forward.staging import StagedFile, Stager, plain


class MeteredFile:
    """A :class:`~reshard.io.tensorfile.TensorFile` stand-in whose reads return ``meta`` tensors and count bytes:
    ``read`` / ``read_block`` with the same arguments, everything else (``tensors``, ``path``, ``structure``)
    passed through to the wrapped file."""

    def __init__(self, file):
        self.file = file
        self.bytes_read = 0
        self.largest_read = 0

    def __getattr__(self, name):
        return getattr(self.file, name)

    def close(self) -> None:
        self.file.close()

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None):
        loc = self.file.tensors[name]
        return self._slice(tuple(loc.shape), loc.dtype, axis, start, length, rows)

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        loc = self.file.tensors[name]
        return self._slice(tuple(loc.shape[1:]), loc.dtype, axis, start, length, rows)

    def _slice(self, shape: tuple[int, ...], dtype: str, axis: int, start: int, length: int | None,
               rows: tuple[int, int] | None):
        shape = list(shape)
        if shape:
            shape[axis] = shape[axis] - start if length is None else length
            if rows and axis:
                shape[0] = rows[1] - rows[0]
        return self.count(tuple(shape), dtype)

    def count(self, shape: tuple[int, ...], dtype: str):
        """Count a read of ``shape`` in stored ``dtype`` and return the ``meta`` tensor it gives."""
        nbytes = math.prod(shape) * dtypes.itemsize(dtype)
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)
        return torch.empty(shape, dtype=dtypes.to_torch(dtype), device="meta")


class RankStream:
    """Rank ``rank`` of ``world``: set by a subclass's constructor are ``config`` (:class:`DecoderConfig`),
    ``vocab_start`` / ``lm_head_start`` (first padded-vocab row of the rank's embedding / head rows),
    ``padded_vocab``, ``tied`` (the head is the embedding table: :meth:`head` returns None for it) and ``files``
    (the paths it reads, for the report). ``any_degree``: the layout's data does not depend on a TP degree, so any
    ``world`` the model divides by can be sliced (Hugging Face, torch_dist, Meta); otherwise ``world`` must be the
    checkpoint's own degree."""

    any_degree: ClassVar[bool] = False
    config: DecoderConfig
    vocab_start: int = 0
    lm_head_start: int = 0
    padded_vocab: int = 0
    tied: bool = False
    #: Where reads land: None, the host (the files' own reads); a :class:`~.staging.Stager`, its device.
    stager: Stager | None = None

    def __init__(self, rank: int, world: int, metered: bool = False):
        self.rank, self.world, self.metered = rank, world, metered
        self.files: list[str] = []
        self._opened: list = []
        self.problems: list[str] = []  # replicated copies found to differ, non-finite weights (for the report)
        self.copies: list[dict] = []  # digests of copies held by several ranks (compared across ranks)

    def check_copy(self, name: str, used: torch.Tensor, used_where: str, other: torch.Tensor, other_where: str,
                   why: str) -> None:
        """Prove ``other`` (a replica a real run computes with) identical, byte for byte, to ``used`` (the copy this
        check computes with); a difference becomes a problem naming both places and the tensor."""
        if self.metered:
            return
        other = other.to(used.device)  # one read staged onto the device, the other (an unstaged file's) not
        if used.dtype == other.dtype and used.shape == other.shape \
                and torch.equal(used.contiguous().view(-1).view(torch.uint8),
                                other.contiguous().view(-1).view(torch.uint8)):
            return
        how = f"max abs diff {(used.double() - other.double()).abs().max().item():g}" \
            if used.shape == other.shape else f"shape {tuple(other.shape)} vs {tuple(used.shape)}"
        self.problems.append(f"replicated copy differs: '{name}' in {other_where} vs the copy in {used_where} "
                             f"({how}); {why}")

    def record_copy(self, key: str, data: torch.Tensor, where: str, used: bool, why: str) -> None:
        """Note the SHA-256 of ``data``, one of several ranks' copies of ``key`` (``used``: the copy this check
        computes with); rank 0 compares the copies of every key (:func:`~.report.copy_problems`). A device tensor
        is hashed 64 MiB at a time on the host."""
        if self.metered:
            return
        import hashlib

        digest = hashlib.sha256()
        for piece in data.contiguous().view(-1).view(torch.uint8).split(64 << 20):
            digest.update(piece.cpu().numpy())
        self.copies.append({"key": key, "sha256": digest.hexdigest(), "where": where, "used": used, "why": why})

    def staged(self, file):
        """``file`` (a TensorFile) read through :attr:`stager` once one is set: a :class:`~.staging.StagedFile`
        where its reads can be staged (:func:`~.staging.plain`), else ``file`` itself (read on the host)."""
        return StagedFile(file, self) if plain(file) else file

    def opened(self, file):
        """Keep ``file`` (a TensorFile) to close with the stream; with ``metered``, wrap it in a MeteredFile, else
        :meth:`staged`."""
        file = MeteredFile(file) if self.metered else self.staged(file)
        self._opened.append(file)
        return file

    @property
    def bytes_read(self) -> int:
        return sum(getattr(f, "bytes_read", 0) for f in self._opened)

    @property
    def largest_read(self) -> int:
        return max((getattr(f, "largest_read", 0) for f in self._opened), default=0)

    def embedding(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the rank's rows of the word embedding, the learned position embedding or None)."""
        raise NotImplementedError

    def layer(self, index: int) -> LayerWeights:
        """Global decoder layer ``index``'s local tensors."""
        raise NotImplementedError

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(final norm weight, its bias or None, the rank's lm_head rows or None when ``tied``)."""
        raise NotImplementedError

    def close(self) -> None:
        for f in self._opened:
            f.close()
        self._opened = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def load_all(self) -> RankWeights:
        """The whole rank at once, in the stored dtype."""
        embedding, positions = self.embedding()
        layers = [self.layer(i) for i in range(self.config.layers)]
        final_norm, final_norm_bias, lm_head = self.head()
        return RankWeights(config=self.config, rank=self.rank, world=self.world, embedding=embedding,
                           vocab_start=self.vocab_start, layers=layers, final_norm=final_norm, lm_head=lm_head,
                           lm_head_start=self.lm_head_start, padded_vocab=self.padded_vocab, dtype=embedding.dtype,
                           files=list(self.files), final_norm_bias=final_norm_bias, position_embedding=positions)


def whole_rank_loader(stream_class: type[RankStream]):
    """``load_rank(path, rank, world, opts) -> RankWeights`` reading the whole rank through ``stream_class``."""
    def load_rank(path: str, rank: int, world: int, opts) -> RankWeights:
        with stream_class(path, rank, world, opts) as stream:
            return stream.load_all()

    load_rank.__doc__ = f"Rank ``rank`` of ``world`` read whole through :class:`{stream_class.__name__}`."
    return load_rank
