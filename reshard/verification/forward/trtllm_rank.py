"""TP rank ``r`` of a TensorRT-LLM checkpoint, from its own ``rank{p * tp + r}.safetensors`` files (every pipeline
stage in sequence).

Split the way TensorRT-LLM runs them: ``attention.qkv`` = ``[q_r; k_r; v_r]`` (``nh/tp`` query heads,
``max(ng/tp, 1)`` KV heads), ``mlp.fc`` / ``mlp.gate`` the rank's gate / up rows, ``attention.dense`` and
``mlp.proj`` column slices; ``lm_head`` rows ``[r * Vp/tp, (r+1) * Vp/tp)`` of the vocab padded to a multiple of
tp. The embedding is whole on every rank (no parallel embedding): the rank keeps its vocab-parallel slice of it,
which is what a vocab-parallel lookup computes. The process count must equal the checkpoint's TP degree.
"""

from __future__ import annotations

import os

import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import trtllm
from reshard.layouts.base import Options, read_json_object
from reshard.layouts.hf_config import read_meaning
from reshard.layouts.trtllm_config import read_trtllm_config
from reshard.mapping_vlm import family_for_architecture
from reshard.verification.forward.rank_stream import RankStream, whole_rank_loader
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, check_world, padded_vocab_for,
                                                       split_stacked_qkv, unpack, vocab_rows)


class TrtllmRankStream(RankStream):
    """Rank ``rank``'s tensors from its own ``rank{p * tp + rank}.safetensors`` of every pipeline stage ``p``."""

    def __init__(self, path: str, rank: int, world: int, opts: Options, metered: bool = False):
        super().__init__(rank, world, metered)
        trt = read_json_object(os.path.join(path, trtllm.CONFIG), "a TensorRT-LLM checkpoint")
        mapping = trt.get("mapping") or {}
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        if world != tp:
            raise ReshardError(f"{path} is a TensorRT-LLM checkpoint at tp={tp}; run the forward check with --nproc "
                               f"{tp} (got {world}), or convert it to tp={world} first")
        ranks = trtllm._rank_files(path)
        missing = [p * tp + rank for p in range(pp) if p * tp + rank not in ranks]
        if missing:
            raise CheckpointError(f"{path}: rank{missing[0]}.safetensors is missing; the checkpoint is incomplete")
        try:
            files = [self.opened(SafetensorsFile(ranks[p * tp + rank])) for p in range(pp)]
            self._setup(path, trt, files, opts)
        except BaseException:
            self.close()
            raise

    def _setup(self, path: str, trt: dict, files: list, opts: Options) -> None:
        self.stage_files, self.path = files, path
        architecture = opts.architecture or trt.get("architecture")
        family = self.family = family_for_architecture(architecture, opts.mapping)
        config, present = read_trtllm_config(trt, family, architecture, files, path)
        dims = family.resolve_dims(config)
        meaning = read_meaning(config, family, architecture, dims, present, bool(trt.get("tie_word_embeddings",
                                                                                        False)), path)
        self.config = decoder = DecoderConfig.from_meaning(meaning)
        check_world(decoder, self.world, meaning.ffn)
        d = decoder.head_dim
        self.q_rows, self.kv_rows = decoder.heads // self.world * d, max(decoder.kv_heads // self.world, 1) * d
        self.layer_specs = [s for s in family.weights if s.role and s.per_layer]
        self.per_stage = meaning.layers // len(files)
        self.padded_vocab = padded_vocab_for(decoder.vocab, self.world)
        self.vocab_start, self.real_rows, self.pad_rows = vocab_rows(decoder.vocab, self.padded_vocab, self.rank,
                                                                     self.world)
        self.lm_head_start = self.vocab_start  # the head's rows per rank are checked to be padded / tp
        self.files = [os.path.relpath(f.path, path) for f in files]

    def _get(self, f, spec, layer: int | None = None):
        name = spec.trtllm.format(layer=layer) if layer is not None else spec.trtllm
        if name not in f.tensors:
            if spec.optional:
                return None
            raise CheckpointError(f"{f.path}: tensor '{name}' is missing")
        return unpack(spec, f.read(name), lambda t: split_stacked_qkv(t, self.q_rows, self.kv_rows)) \
            if spec.split == "qkv" else f.read(name)

    def layer(self, index: int) -> LayerWeights:
        f = self.stage_files[index // self.per_stage]
        return LayerWeights(**{s.role: self._get(f, s, index % self.per_stage) for s in self.layer_specs})

    def embedding(self):
        """The rank's vocab-parallel rows of the whole table (read whole: the rank file holds all of it). Every
        rank's copy serves all of a real run's lookups, so each vocab slice of this copy is noted
        (:meth:`RankStream.record_copy`) for rank 0 to compare with the copy of the rank that computes with it."""
        spec = self.family.role_spec("embedding")
        table = self._get(self.stage_files[0], spec)
        per = self.padded_vocab // self.world
        where = os.path.relpath(self.stage_files[0].path, self.path)
        for r in range(self.world):
            lo, hi = r * per, min((r + 1) * per, self.config.vocab)
            if lo < hi:
                self.record_copy(f"'{spec.trtllm}' rows {lo}..{hi - 1}", table[lo:hi], where, used=r == self.rank,
                                 why="every rank's whole copy serves its own lookups in a real run")
        start, real, pad = self.vocab_start, self.real_rows, self.pad_rows
        rows = table[start:start + real]
        return (torch.cat([rows, table.new_zeros(pad, self.config.hidden)]) if pad else rows.clone()), None

    def head(self):
        last, role = self.stage_files[-1], self.family.role_spec
        head = self._get(last, role("lm_head"))
        if head.shape[0] * self.world < self.config.vocab:
            raise CheckpointError(f"{last.path}: lm_head holds {head.shape[0]} rows per rank, fewer than the vocab")
        if head.shape[0] != self.padded_vocab // self.world:
            raise CheckpointError(f"{last.path}: lm_head holds {head.shape[0]} rows, expected "
                                  f"{self.padded_vocab // self.world}")
        return self._get(last, role("final_norm")), None, head


load_rank = whole_rank_loader(TrtllmRankStream)
