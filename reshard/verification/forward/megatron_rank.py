"""TP rank ``r`` of a Megatron-Core ``torch`` checkpoint, from its own files only.

Rank ``r`` opens ``mp_rank_{r:02d}`` (pp=1) or ``mp_rank_{r:02d}_{p:03d}`` for every pipeline stage ``p`` and
runs the stages in sequence; with a virtual pipeline each file holds chunks ``model0``, ``model1``, ... and the
global layer order is chunk-major (chunk 0 of every stage, then chunk 1, ...). Fused tensors are split the way
Megatron-Core runs them: ``linear_qkv`` per local KV group ``[q heads of the group; k; v]``, ``linear_fc1`` =
``[gate_r; up_r]``; embedding and output layer hold rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the padded vocab.
The process count must equal the checkpoint's TP degree (a Megatron rank file is only meaningful at its own
degree); convert first to check another degree. With expert parallelism every EP folder ``mp_rank_{r:02d}_{e:03d}``
holds its own copy of the dense tensors: the rank computes with EP folder 0's and proves the others identical.
Multi-head latent attention's down projections are read as stored: whole (Transformer Engine spec) or the rank's
row block (local spec), which the decoder runs as Megatron-Core does (its outputs all-gathered over the ranks).
"""

from __future__ import annotations

import os
import re


from reshard.core.canonical import instance
from reshard.errors import CheckpointError, ReshardError
from reshard.io.torch_format import TorchFile
from reshard.verification.forward.rank_weights import expert_parts
from reshard.layouts import megatron
from reshard.layouts.base import Options
from reshard.mapping import config_condition
from reshard.verification.forward import gated_deltanet, mamba2
from reshard.verification.forward.rank_stream import RankStream, whole_rank_loader
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, check_world, split_grouped_qkv,
                                                       split_halves, unpack)

_CHUNK = re.compile(r"^model\d*$")
_LAYER = re.compile(r"^(?:language_model\.)?decoder\.layers\.(\d+)\.")  # a VLM: language_model.


def _ranks(path: str) -> tuple[str, dict[tuple[int, int, int], str], object]:
    """The iteration folder, its rank files by (tp, pp, ep) rank, and the run's args."""
    folder, _ = megatron._iteration_dir(path)
    found = megatron.scan_rank_folders(folder)
    probe = TorchFile(found[min(found)])
    args = probe.structure.get("args") if isinstance(probe.structure, dict) else None
    probe.close()
    if args is None:
        raise CheckpointError(f"{probe.path}: no 'args' in the checkpoint: cannot tell the model config")
    grid = megatron.rank_grid(found, int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
                              int(getattr(args, "expert_model_parallel_size", 1) or 1), folder)
    return folder, grid, args


def _chunks(f: TorchFile) -> list[str]:
    keys = [k for k in f.structure if isinstance(k, str) and _CHUNK.match(k)]
    if not keys:
        raise CheckpointError(f"{f.path}: no 'model' state dict in the checkpoint")
    return sorted(keys, key=lambda k: -1 if k == "model" else int(k[5:]))


def _layer_count(f: TorchFile, chunk: str) -> int:
    found = [int(m.group(1)) for key in f.structure[chunk] if (m := _LAYER.match(key))]
    return max(found) + 1 if found else 0


def _legacy_experts(f: TorchFile, chunk: str, specs, layer: int, ep_rank: int, per_rank: int, hidden: int) -> dict:
    """Legacy GroupedMLP experts as megatron-core runs them: ``weight1.view(E_loc, H, -1)[j].T`` is local expert
    j's ``[gate; up]``, ``weight2.view(E_loc, -1, H)[j].T`` its down projection."""
    names = {s.role: f"{chunk}/" + s.megatron_legacy_grouped.format(layer=layer) for s in specs}
    w1 = f.read(names["expert_gate"]).reshape(per_rank, hidden, -1)
    w2 = f.read(names["expert_down"]).reshape(per_rank, -1, hidden)
    out = {}
    for j in range(per_rank):
        gate, up = split_halves(w1[j].T)
        out[ep_rank * per_rank + j] = (gate, up, w2[j].T)
    return out


class MegatronRankStream(RankStream):
    """Rank ``rank``'s tensors: per stage, its own file for everything but the routed experts, which come from a
    file of every EP rank holding this rank's expert-TP shard (local index j of EP rank e = global
    ``e * E/ep + j``); with an expert-TP degree below tp only ranks below it compute the experts (the others
    hold copies)."""

    def __init__(self, path: str, rank: int, world: int, opts: Options, metered: bool = False):
        super().__init__(rank, world, metered)
        folder, ranks, args = _ranks(path)
        tp = max(t for t, _, _ in ranks) + 1
        pp = max(p for _, p, _ in ranks) + 1
        ep = max(e for _, _, e in ranks) + 1
        if world != tp:
            raise ReshardError(f"{path} is a Megatron checkpoint at tp={tp}; run the forward check with --nproc "
                               f"{tp} (got {world}), or convert it to tp={world} first")
        etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
        missing = megatron.missing_rank_folders(ranks, tp, pp, ep, etp)
        if missing:
            raise CheckpointError(f"{folder}: rank folder {missing[0]} is missing; the checkpoint is incomplete")

        def holder(p: int, e: int) -> str | None:
            """This rank's folder for EP rank e, else (expert-TP below tp) one holding the same expert-TP shard."""
            if (rank, p, e) in ranks:
                return ranks[(rank, p, e)]
            return next((ranks[(t, p, e)] for t in range(rank % etp, tp, etp) if (t, p, e) in ranks), None)

        dense = [next(ranks[(rank, p, e)] for e in range(ep) if (rank, p, e) in ranks) for p in range(pp)]
        opened: dict[str, object] = {}  # a file serves as dense and expert file: open (parse) it once

        def open_once(file_path: str):
            if file_path not in opened:
                opened[file_path] = self.opened(TorchFile(file_path))
            return opened[file_path]

        self.path = path
        try:
            # per stage: the rank's own file (everything but the routed experts), then one file per EP rank
            self.expert_files = [[open_once(dense[p])] + [open_once(holder(p, e)) for e in range(ep)]
                                 for p in range(pp)]
            # the other EP folders of this TP rank hold their own copies of its dense tensors
            self.dense_copies = {dense[p]: [open_once(ranks[(rank, p, e)]) for e in range(ep)
                                            if (rank, p, e) in ranks and ranks[(rank, p, e)] != dense[p]]
                                 for p in range(pp)}
            # with expert-TP below tp, this rank's own EP folders hold copies of its expert-TP shard's experts
            self.own_expert_files = [[open_once(ranks[(rank, p, e)]) if (rank, p, e) in ranks else None
                                      for e in range(ep)] for p in range(pp)]
            self._setup(path, folder, args, opts)
        except BaseException:
            self.close()
            raise

    def _setup(self, path: str, folder: str, args, opts: Options) -> None:
        self.stage_files = files = [stage[0] for stage in self.expert_files]
        root = megatron._checkpoint_root(path, folder)
        meaning, family, hf_config = megatron.read_args(args, opts, root, folder)
        self.config = config = DecoderConfig.from_meaning(meaning)
        config.gdn = gated_deltanet.decoder_fields(hf_config, family)
        config.mamba = mamba2.decoder_fields(hf_config, family)
        self.mixer_held = gated_deltanet.layer_filter(family, hf_config, config.layers)
        check_world(config, self.world, meaning.ffn)
        all_keys = {k for f in files for c in _chunks(f) for k in f.structure[c]}
        self.spec_name = "te" if any(k.endswith(".layer_norm_weight") for k in all_keys) else "local"
        self.chunks = chunks = _chunks(files[0])
        self.family = family
        self.sparse_layers = set(meaning.sparse_layers())
        self.grouped = any(megatron.GROUPED.search(k) for k in all_keys)
        self.legacy = any(megatron.LEGACY_GROUPED.search(k) for k in all_keys)
        self.etp = int(getattr(args, "expert_tensor_parallel_size", None) or self.world)
        self.experts_per_rank = meaning.experts // (len(self.expert_files[0]) - 1) if meaning.experts else 0
        self._cache: dict = {}
        self.layer_specs = [s for s in family.weights if s.role and s.per_layer and not s.per_expert
                            and (s.when is None or config_condition(s.when, hf_config))]
        self.expert_specs = [s for s in family.weights if s.per_expert]
        self.places = []  # global layer -> (chunk, stage, local index): chunk-major, then pipeline stage
        for chunk in chunks:
            for stage, f in enumerate(files):
                if chunk in f.structure:
                    self.places += [(chunk, stage, i) for i in range(_layer_count(f, chunk))]
        if len(self.places) != config.layers:
            raise CheckpointError(f"{folder}: rank {self.rank}'s files hold {len(self.places)} layers but the args "
                                  f"say {config.layers}: a pipeline stage is missing or inconsistent")
        role = family.role_spec
        embedding = files[0].tensors[self._key(chunks[0], role("embedding"))]
        self.rows = rows = embedding.shape[0]
        self.vocab_start = self.lm_head_start = self.rank * rows
        self.padded_vocab = rows * self.world
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        # Tied with pp=1: the head is the embedding. Tied with pp>1: the last stage keeps its own copy.
        self.tied = tied and len(files) == 1 and len(chunks) == 1
        self.untied_head = not tied
        self.files = [os.path.relpath(f.path, path) for f in files]

    def _key(self, chunk: str, spec, layer: int | None = None, name_spec=None, global_layer=None,
             expert: int | None = None) -> str:
        template = (name_spec or spec).megatron_name(self.spec_name, global_layer in self.sparse_layers,
                                                     self.grouped)
        return f"{chunk}/{instance(template, layer, expert)}"

    def _get(self, f, chunk: str, spec, layer: int | None = None, name_spec=None, global_layer=None,
             expert: int | None = None):
        """``spec``'s local tensor (its slot of a fused tensor); None when an optional weight is absent."""
        key = self._key(chunk, spec, layer, name_spec, global_layer, expert)
        if key not in f.tensors:
            if spec.optional:
                return None
            raise CheckpointError(f"{f.path}: tensor '{key.split('/', 1)[1]}' is missing from the rank file")
        if (f.path, key) not in self._cache:
            self._cache.clear()  # a fused tensor's slots are read one after another
            self._cache[(f.path, key)] = f.read(key)
            if expert is None:  # a routed expert has one copy (its EP folder's); dense tensors one per EP folder
                self._check_dense_copies(f, key)
        config = self.config
        q_per_group = config.heads // config.kv_heads * (2 if gated_deltanet.dims(config).get("gated_query") else 1)
        return unpack(spec, self._cache[(f.path, key)],
                      lambda t: split_grouped_qkv(t, q_per_group, config.head_dim))

    def _check_dense_copies(self, f, key: str) -> None:
        """Every other EP folder's copy of a dense tensor read from ``f`` must be identical to it (read one at a
        time): a real run computes each EP rank's tokens with its own copy."""
        name = key.split("/", 1)[1]
        for other in self.dense_copies.get(f.path, ()):
            where = os.path.relpath(other.path, self.path)
            if key not in other.tensors:
                self.problems.append(f"replicated copy missing: '{name}' is not in {where} (every EP folder holds "
                                     "the dense tensors)")
                continue
            self.check_copy(name, self._cache[(f.path, key)], os.path.relpath(f.path, self.path), other.read(key),
                            where, "each EP rank computes with its own copy")

    def layer(self, index: int) -> LayerWeights:
        chunk, stage, i = self.places[index]
        f, sparse = self.stage_files[stage], index in self.sparse_layers
        held = self.mixer_held([s for s in self.layer_specs if s.on_layer(sparse)], index)
        weights = LayerWeights(**{s.role: self._get(f, chunk, s, i, global_layer=index) for s in held})
        gated_deltanet.from_megatron(weights, held, self.config)
        computes = self.rank < self.etp
        copies = self.etp < self.world  # every TP rank sharing an expert-TP shard holds (and runs) a copy
        if sparse and (computes or copies):
            for e, ef in enumerate(self.expert_files[stage][1:]):
                own = self.own_expert_files[stage][e]
                experts = self._experts(ef if computes else own, chunk, i, index, e) if computes or own else {}
                if copies and own is not None:
                    where = os.path.relpath(own.path, self.path)
                    for g, parts in experts.items():
                        for part, t in zip(("gate", "up", "down"), parts):
                            self.record_copy(f"layer {index} expert {g} {part} (expert-TP shard "
                                             f"{self.rank % self.etp})", t, where, used=computes,
                                             why="each TP rank of an expert-TP shard computes its tokens with its "
                                                 "own copy")
                if computes:
                    weights.experts.update(experts)
        self._cache.clear()
        return weights

    def _experts(self, f, chunk: str, i: int, index: int, e: int) -> dict:
        """The routed experts EP rank ``e``'s file ``f`` holds for local layer ``i`` (global ``index``), by
        global expert index: (gate, up, down) each."""
        if self.legacy:
            return _legacy_experts(f, chunk, self.expert_specs, i, e, self.experts_per_rank, self.config.hidden)
        out = {}
        for j in range(self.experts_per_rank):
            parts = {s.role: self._get(f, chunk, s, i, global_layer=index, expert=j) for s in self.expert_specs}
            out[e * self.experts_per_rank + j] = expert_parts(parts)
        return out

    def embedding(self):
        role, first = self.family.role_spec, self.stage_files[0]
        positions = self._get(first, self.chunks[0], role("position_embedding")) \
            if role("position_embedding") else None
        table = self._get(first, self.chunks[0], role("embedding"))
        self._cache.clear()
        return table, positions

    def head(self):
        role = self.family.role_spec
        last = self.stage_files[-1]
        last_chunk = _chunks(last)[-1]
        head = role("lm_head")
        lm_head = None if self.tied else \
            self._get(last, last_chunk, head if self.untied_head else role("embedding"), name_spec=head)
        if lm_head is not None and lm_head.shape[0] != self.rows:
            raise CheckpointError(f"{last.path}: output_layer has {lm_head.shape[0]} rows, the embedding "
                                  f"{self.rows}")
        final_bias = role("final_norm_bias")
        out = (self._get(last, last_chunk, role("final_norm")),
               self._get(last, last_chunk, final_bias) if final_bias else None, lm_head)
        self._cache.clear()
        return out


load_rank = whole_rank_loader(MegatronRankStream)
