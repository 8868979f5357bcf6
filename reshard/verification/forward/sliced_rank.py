"""Rank ``r`` of ``world`` from a checkpoint whose data does not depend on a TP degree (Hugging Face, Megatron
``torch_dist``): slice the canonical tensors.

Reads only the rows / columns the rank holds, through the source's canonical index (whatever files and chunks
hold them), by each weight's decoder role: q heads ``[r*nh/w, (r+1)*nh/w)``, KV heads ``[r*ng/w, ...)`` or, when ``w > ng``, KV head
``r // (w/ng)``; gate/up rows and o/down columns by 1/w; the vocab padded to a multiple of ``w`` and split evenly
(padding rows are zeros). Multi-head latent attention: whole heads of ``q_b`` / ``q`` and ``kv_b`` rows and of
``o`` columns; ``q_a``, ``kv_a`` and their norms whole.
"""

from __future__ import annotations

import math
import os

import torch

from reshard.core.canonical import instance
from reshard.core.plan import CanonicalIndex, TargetTensor
from reshard.errors import ReshardError
from reshard.io.assemble import assemble, read_op
from reshard.io import dtypes
from reshard.layouts.base import Options
from reshard.layouts.registry import open_checkpoint
from reshard.verification.forward import gated_deltanet, mamba2
from reshard.verification.forward.rank_stream import MeteredFile, RankStream, whole_rank_loader
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, check_world, kv_heads_of_rank,
                                                       padded_vocab_for, vocab_rows)
from reshard.verification.forward.rank_weights import expert_parts
from reshard.verification.forward.staging import assemble_on


#: The decoder roles a rank holds part of, by how the part is cut (the others are whole on every rank).
_Q_ROLES, _KV_ROLES = ("q", "q_bias"), ("k", "v", "k_bias", "v_bias")
_F_ROLES, _COLUMN_ROLES = ("gate", "up", "gate_bias", "up_bias"), ("o", "down")


class SlicedRankStream(RankStream):
    """Rank ``rank`` of any ``world`` the model divides by, sliced from the canonical view."""

    any_degree = True

    def __init__(self, path: str, rank: int, world: int, opts: Options, metered: bool = False):
        super().__init__(rank, world, metered)
        self.source = open_checkpoint(path, opts)
        try:
            self._setup()
        except BaseException:
            self.source.close()
            raise

    def _setup(self) -> None:
        source, rank, world = self.source, self.rank, self.world
        model = self.model = source.model
        self.config = config = DecoderConfig.from_meaning(model.meaning)
        config.gdn = gated_deltanet.decoder_fields(model.config, model.family)
        config.mamba = mamba2.decoder_fields(model.config, model.family)
        check_world(config, world, model.dims["F"])
        self.index = CanonicalIndex(source.stored, {name: t.shape for name, t in model.tensors.items()})
        d = config.head_dim
        q_per = config.heads // world
        kv = kv_heads_of_rank(config.kv_heads, rank, world)
        f_per = model.dims["F"] // world
        meaning = model.meaning
        i_per, s_per = meaning.expert_ffn // world, meaning.shared_expert_ffn // world
        for what, size in (("expert", meaning.expert_ffn), ("shared-expert", meaning.shared_expert_ffn)):
            if size % world:
                raise ReshardError(f"cannot split the {what} intermediate size {size} over {world} ranks: choose "
                                   "--nproc dividing it")
        self.spans = {**dict.fromkeys(_Q_ROLES, (0, rank * q_per * d, q_per * d)),
                      **dict.fromkeys(_KV_ROLES, (0, kv.start * d, len(kv) * d)),
                      **dict.fromkeys(_F_ROLES, (0, rank * f_per, f_per)),
                      "o": (1, rank * q_per * d, q_per * d), "down": (1, rank * f_per, f_per),
                      "expert_gate": (0, rank * i_per, i_per), "expert_up": (0, rank * i_per, i_per),
                      "expert_down": (1, rank * i_per, i_per), "shared_gate": (0, rank * s_per, s_per),
                      "shared_up": (0, rank * s_per, s_per), "shared_down": (1, rank * s_per, s_per)}
        self.spans.update(sinks=(0, rank * q_per, q_per), expert_gate_bias=(0, rank * i_per, i_per),
                          expert_up_bias=(0, rank * i_per, i_per))  # gpt-oss; the down bias whole (rank 0 adds it)
        if config.mla:  # whole heads of dn + dr (q_b / q), dn + dv (kv_b) rows and dv (o) columns; q_a, kv_a whole
            dq, dkv, dv = d + config.rope_head_dim, d + config.v_head_dim, config.v_head_dim
            self.spans.update({"q": (0, rank * q_per * dq, q_per * dq), "q_b": (0, rank * q_per * dq, q_per * dq),
                               "kv_b": (0, rank * q_per * dkv, q_per * dkv), "o": (1, rank * q_per * dv, q_per * dv)})
        self.spans.update(gated_deltanet.sliced_spans(config, rank, world, q_per), **mamba2.sliced_spans(config, rank,
                                                                                                        world))
        self.padded_vocab = padded_vocab_for(config.vocab, world)
        self.vocab_start, self.real_rows, self.pad_rows = vocab_rows(config.vocab, self.padded_vocab, rank, world)
        self.lm_head_start = self.vocab_start
        self.tied = model.tied
        self.files = [f.path for f in source.files]
        self.meters = [MeteredFile(f) for f in source.files] if self.metered else []
        self._opened = self.meters
        self.reading = self.meters or [self.staged(f) for f in source.files]  # what the reads go through
        self.replica_checks: dict[str, list] = {}  # canonical name -> this rank's share of the stored replicas
        for i, check in enumerate(dict.fromkeys(self.index.checks)):  # each distinct pair once
            if i % world == rank:
                self.replica_checks.setdefault(check.canonical, []).append(check)

    def close(self) -> None:
        self.source.close()

    def _read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        tensor = self.model.tensors[name]
        assert axis == tensor.axis, (name, axis)  # every slice below is along the tensor's split axis
        length = tensor.shape[axis] - start if length is None else length
        shape = tuple(length if i == axis else n for i, n in enumerate(tensor.shape))
        reads = self.index.reads_for(name, start, start + length, 0)
        self._check_replicas(name)
        if self.metered:  # the bytes each read op takes from its source tensor, in the stored dtype
            row = math.prod(shape) // length if length else 0
            for op in reads:
                self.meters[op.source].count((op.length * row,), self.source.files[op.source].tensors[op.tensor].dtype)
            return torch.empty(shape, dtype=dtypes.to_torch(self.model.dtypes[name]), device="meta")
        target = TargetTensor(name, shape, self.model.dtypes[name], axis, reads)
        if self.stager is not None:
            return assemble_on(target, self.reading, self.stager.device)
        return assemble(target, self.reading)

    def _check_replicas(self, name: str) -> None:
        """Where the source stores ``name`` more than once (Meta's norms in every consolidated file, replicated
        torch_dist chunks), each copy a real run computes with must equal the one read here: this rank proves its
        share of them (one pair at a time, when ``name`` is read)."""
        files = self.reading
        for check in self.replica_checks.pop(name, ()):
            used, other = (read_op(op, check.axis, files) for op in (check.first, check.other))
            where = [os.path.relpath(files[op.source].path, self.source.root) for op in (check.first, check.other)]
            self.check_copy(name, used, where[0], other, where[1], "each rank of a real run computes with its own "
                            "copy")

    def _role_tensors(self, layer: int) -> dict:
        out: dict = {}
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for spec in self.model.family.weights:
            if spec.role is None or not spec.per_layer:
                continue
            for expert in range(self.model.num_experts) if spec.per_expert else [None]:
                name = instance(spec.hf, layer, expert)
                if name not in self.model.tensors:
                    continue
                tensor = self._read(name, *self.spans.get(spec.role, ()))
                if spec.per_expert:  # every rank computes its 1/world slice of every expert
                    experts.setdefault(expert, {})[spec.role] = tensor
                else:
                    out[spec.role] = tensor
        if experts:
            out["experts"] = {e: expert_parts(p) for e, p in experts.items()}
        return out

    def _vocab_slice(self, role: str) -> torch.Tensor:
        spec = self.model.family.role_spec(role)
        rows = self._read(spec.hf, 0, self.vocab_start, self.real_rows)
        return torch.cat([rows, rows.new_zeros(self.pad_rows, self.config.hidden)]) if self.pad_rows else rows

    def layer(self, index: int) -> LayerWeights:
        layer = gated_deltanet.sliced_layer(LayerWeights(**self._role_tensors(index)), self.config, self.rank,
                                            self.world)
        return mamba2.sliced_layer(layer, self.config, self.rank, self.world)

    def _whole(self, role: str) -> torch.Tensor | None:
        spec = self.model.family.role_spec(role)
        if spec is None or spec.hf not in self.model.tensors:
            return None
        return self._read(spec.hf)

    def embedding(self):
        return self._vocab_slice("embedding"), self._whole("position_embedding")

    def head(self):
        final_norm = self._whole("final_norm")
        if final_norm is None:
            raise ReshardError("the checkpoint has no final norm weight")
        return final_norm, self._whole("final_norm_bias"), None if self.tied else self._vocab_slice("lm_head")


load_rank = whole_rank_loader(SlicedRankStream)
