"""TP rank ``r`` of a vLLM ``sharded_state`` folder, from its own ``model-rank-{r}-part-*.safetensors`` only.

Split the way vLLM runs them: ``qkv_proj`` = ``[q_r; k_r; v_r]`` (``nh/tp`` query heads, ``max(ng/tp, 1)`` KV
heads), ``gate_up_proj`` = ``[gate_r; up_r]``, ``o_proj`` / ``down_proj`` column slices (their biases whole),
embedding and ``lm_head`` rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the vocab padded to 64; a tied model stores only the
name vLLM's loader keeps, which then serves as both. The process count must equal the folder's TP degree.
Multi-head latent attention: ``fused_qkv_a_proj`` = ``[q_a; kv_a]`` whole (``kv_a_proj_with_mqa`` alone without q
LoRA), ``q_b_proj`` / ``q_proj`` / ``kv_b_proj`` rows and ``o_proj`` columns by whole heads.
"""

from __future__ import annotations

import os

from reshard.errors import CheckpointError, ReshardError
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import hf, vllm
from reshard.layouts.base import Options
from reshard.layouts.hf_config import read_meaning
from reshard.mapping_vlm import family_for_architecture, flat_view
from reshard.mapping import REPLICATED_PACK, config_condition
from reshard.verification.forward import gated_deltanet, llama4_layer, mamba2
from reshard.io.pair_rows import end_to_end
from reshard.verification.forward.rank_stream import RankStream, whole_rank_loader
from reshard.verification.forward.rank_weights import expert_parts
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, check_world, split_halves,
                                                       split_stacked_qkv, unpack)


def _experts(specs, layer: int, where: dict, experts: int, rank: int, world: int) -> dict:
    """The routed experts of a stacked vLLM layer: every expert's 1/tp slice (``w13`` = [gate_r; up_r]), or with
    expert parallelism (fewer stacked than the model's experts) the rank's block of whole experts."""
    stacked, names = {}, {}
    for spec in specs:
        name = spec.vllm_name.format(layer=layer)
        if name not in where:
            raise CheckpointError(f"tensor '{name}' is missing from rank {rank}'s files")
        same = next((t for r, t in stacked.items() if names[r] == name), None)  # w13: gate and up, read once
        stacked[spec.role] = same if same is not None else \
            end_to_end(where[name].read(name)) if spec.vllm_interleaved else where[name].read(name)
        names[spec.role] = name
    held = stacked["expert_down"].shape[0]
    ids = vllm.expert_block(experts, world, rank) if held < experts else range(experts)
    out = {}
    for j, e in enumerate(ids):
        parts = {role: t[j] for role, t in stacked.items()}
        for role in ("expert_gate", "expert_gate_bias"):  # w13 (and gpt-oss's w13_bias): [gate_r; up_r]
            if role in parts:
                parts[role], parts[role.replace("gate", "up")] = split_halves(parts[role])
        out[e] = expert_parts(parts)
    return out


def _names_and_packs(family, held: list, dims: dict) -> tuple[dict, dict]:
    """(HF template -> vLLM name, HF template -> (first row, rows) in its replicated pack) for the weights the
    model ``held``: a weight whose pack partner the model lacks is stored alone under its ``vllm_unfused`` name
    (as reshard's vLLM layout writes it); a pack is its members whole, in declaration order."""
    names = vllm.vllm_name_table(family, lambda s: s in held)
    packs: dict[str, list] = {}
    for spec in held:
        if spec.split == REPLICATED_PACK and spec.slot:
            packs.setdefault(names[spec.hf], []).append(spec)
    rows = {}
    for members in packs.values():
        start = 0
        for spec in members:
            size = family.shape_of(spec, dims)[0]
            if len(members) > 1:
                rows[spec.hf] = (start, size)
            start += size
    return names, rows


class VllmRankStream(RankStream):
    """Rank ``rank``'s tensors from its own ``model-rank-{rank}-part-*.safetensors``."""

    def __init__(self, path: str, rank: int, world: int, opts: Options, metered: bool = False):
        super().__init__(rank, world, metered)
        ranks = vllm._rank_files(path)
        if world != len(ranks):
            raise ReshardError(f"{path} is a vLLM folder for tensor_parallel_size={len(ranks)}; run the forward "
                               f"check with --nproc {len(ranks)} (got {world}), or convert it to tp={world} first")
        try:
            files = [self.opened(SafetensorsFile(p)) for p in ranks[rank]]
            self._setup(path, files, opts)
        except BaseException:
            self.close()
            raise

    def _setup(self, path: str, files: list, opts: Options) -> None:
        self.path = path
        hf_config = hf.read_config(path)
        family = self.family = family_for_architecture(hf.architecture_of(hf_config, opts), opts.mapping, hf_config)
        hf_config = flat_view(hf_config) if family.multimodal else hf_config
        dims = family.resolve_dims(hf_config)
        where = self.where = {name: f for f in files for name in f.tensors}
        present = {s.hf for s in family.weights if s.optional and s.vllm_name.format(layer=0) in where}
        role = family.role_spec
        emb_name, head_name = role("embedding").vllm_name, role("lm_head").vllm_name
        self.tied = not (emb_name in where and head_name in where)
        meaning = self.meaning = read_meaning(hf_config, family, hf.architecture_of(hf_config, opts), dims, present,
                                              self.tied, path)
        self.config = config = DecoderConfig.from_meaning(meaning)
        config.gdn = gated_deltanet.decoder_fields(hf_config, family)
        config.mamba = mamba2.decoder_fields(hf_config, family)
        self.mixer_held = gated_deltanet.layer_filter(family, hf_config, dims["L"])
        check_world(config, self.world, dims["F"])
        d = config.head_dim
        self.q_rows = config.heads // self.world * d
        self.kv_rows = max(config.kv_heads // self.world, 1) * d
        self.q_rows *= 2 if gated_deltanet.dims(config).get("gated_query") else 1  # Qwen3-Next: per head [q; gate]
        self.table = vllm.kept_tied_name([emb_name, head_name], family) if self.tied else emb_name
        if self.table not in where:
            raise CheckpointError(f"{path}: rank {self.rank} holds neither '{emb_name}' nor '{head_name}'")
        rows = where[self.table].tensors[self.table].shape[0]
        self.vocab_start = self.lm_head_start = self.rank * rows
        self.padded_vocab = rows * self.world
        self.sparse_layers = set(meaning.sparse_layers())
        held = [s for s in family.weights if s.when is None or config_condition(s.when, hf_config)]
        self.names, self.pack_rows = _names_and_packs(family, held, dims)
        self.layer_specs = [s for s in held if s.role and s.per_layer and not s.per_expert]
        self._cache: dict = {}
        self.expert_specs = [s for s in family.weights if s.per_expert]
        self.files = [os.path.relpath(f.path, path) for f in files]

    def _get(self, spec, layer: int | None = None):
        """``spec``'s local tensor (its slot of a fused tensor); None when an optional weight is absent."""
        template = self.names.get(spec.hf, spec.vllm_name)
        name = template.format(layer=layer) if layer is not None else template
        if name not in self.where:
            if spec.optional:
                return None
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing from rank {self.rank}'s files")
        if name not in self._cache:  # a fused tensor's members: read it once per step (the step holds it anyway)
            self._cache[name] = self.where[name].read(name)
        stored = self._cache[name]
        if spec.hf in self.pack_rows:  # a member of a replicated pack
            start, rows = self.pack_rows[spec.hf]
            return stored[start:start + rows]
        return unpack(spec, stored, lambda t: split_stacked_qkv(t, self.q_rows, self.kv_rows))

    def layer(self, index: int) -> LayerWeights:
        held = self.mixer_held([s for s in self.layer_specs if s.on_layer(index in self.sparse_layers)], index)
        weights = mamba2.from_vllm(LayerWeights(**{s.role: self._get(s, index) for s in held}), held)
        if self.meaning.llama4:  # vLLM permuted Llama 4's q / k rows to rotate-half order
            llama4_layer.unpermute_qk(weights, self.config.head_dim)
        self._cache = {}
        if index in self.sparse_layers:
            weights.experts = _experts(self.expert_specs, index, self.where, self.meaning.experts, self.rank,
                                       self.world)
        return weights

    def _optional(self, role: str):
        spec = self.family.role_spec(role)
        return self._get(spec) if spec else None

    def embedding(self):
        table = self.where[self.table].read(self.table) if self.tied else self._get(self.family.role_spec("embedding"))
        out = table, self._optional("position_embedding")
        self._cache = {}
        return out

    def head(self):
        role = self.family.role_spec
        out = (self._get(role("final_norm")), self._optional("final_norm_bias"),
               None if self.tied else self._get(role("lm_head")))
        self._cache = {}
        return out


load_rank = whole_rank_loader(VllmRankStream)
