"""A family's ``[maxtext]`` table: MaxText's parameter names and the conventions its checkpoints cannot show.

Spec: maxtext-orbax.md sections 3, 4 and 7.4. The table, in a family's mapping file::

    [maxtext]
    stack = "layers"          # layers | pairs (Gemma 2) | pattern6 (Gemma 3) | dense_moe (DeepSeek)
    [maxtext.models."llama3.1"]                  # a MaxText model-name prefix (longest prefix wins)
    architectures = ["LlamaForCausalLM"]         # which HF architectures it is (default: all of the family's)
    rope = "interleaved"                         # q, k rows in Meta's order (default "half": HF's)
    query_scale = "head_dim"                     # q kernel * 1/sqrt(head_dim) | "query_pre_attn_scalar" | none
    norm_offset = 1.0                            # every RMSNorm scale stored as 1 + w (Gemma)
    embedding_scale = "f32_sqrt_hidden"          # embedding * sqrt(H) (Gemma 1/2) | "bf16_sqrt_hidden" (Gemma 3)
    vocab = [256000, 256128]                     # [HF vocab, MaxText vocab_size] of the released models (4.5)
    [maxtext.weights]
    "model.layers.{layer}.self_attn.q_proj.weight" = "self_attention.query.kernel"
    "model.embed_tokens.weight" = "token_embedder.embedding"

A per-layer weight's name is the sub-name under one layer of the stack (``{s}``: Gemma 2's ``local`` / ``global``);
others are under ``params.params``. A weight with ``{expert}`` is one ``[E, in, out]`` leaf per layer. Scanned
leaves stack the layers on axis 1 (``param_scan_axis``); unscanned ones are ``layers_<i>``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field

from reshard.errors import MappingError, PlanError

PREFIX = "params.params."
STACKS = ("layers", "pairs", "pattern6", "dense_moe")
MODEL_KEYS = {"architectures", "rope", "query_scale", "norm_offset", "embedding_scale", "vocab"}
QUERY_SCALES = ("head_dim", "query_pre_attn_scalar")
EMBEDDING_SCALES = ("f32_sqrt_hidden", "bf16_sqrt_hidden")
LAYER_AXIS = 1  # MaxText's param_scan_axis (the only one read or written)


@dataclass(frozen=True)
class Conventions:
    """What a MaxText model name says that the shapes cannot (section 4.6)."""

    model: str = ""
    rope: str = "half"
    query_scale: str | None = None
    norm_offset: float = 0.0
    embedding_scale: str | None = None
    vocab: tuple[int, int] | None = None  # (HF vocab, MaxText vocab_size) of the released models

    def key(self) -> tuple:
        return (self.rope, self.query_scale, self.norm_offset, self.embedding_scale)


@dataclass(frozen=True)
class MaxTextTable:
    """A family's ``[maxtext]`` table, parsed."""

    family: str
    stack: str
    weights: dict[str, str]
    models: dict[str, Conventions]
    architectures: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def candidates(self, architecture: str) -> list[Conventions]:
        return [c for name, c in self.models.items()
                if not self.architectures.get(name) or architecture in self.architectures[name]]

    def conventions(self, architecture: str, model: str | None, where: str) -> Conventions:
        """The conventions of MaxText model ``model`` (a full name such as ``llama3.1-8b``: its longest prefix in
        the table); without a name, the one every candidate for ``architecture`` shares, else refused."""
        names = ", ".join(sorted(self.models))
        if model:
            found = [p for p in self.models if model == p or model.startswith(p + "-") or model.startswith(p)]
            if not found:
                raise PlanError(f"{where}: --maxtext-model {model} is not a MaxText model of the {self.family} "
                                f"family (names start with {names})")
            prefix = max(found, key=len)
            if self.architectures.get(prefix) and architecture not in self.architectures[prefix]:
                raise PlanError(f"{where}: --maxtext-model {model} is a {'/'.join(self.architectures[prefix])} "
                                f"model, not {architecture}: pass the MaxText model name of this checkpoint")
            return self.models[prefix]
        options = self.candidates(architecture)
        if not options:
            raise PlanError(f"{where}: MaxText has no {architecture} model in mapping '{self.family}'")
        if len({c.key() for c in options}) > 1:
            raise PlanError(f"{where}: MaxText {architecture} checkpoints differ by model name (RoPE order, query "
                            f"scaling), which the weights do not show: pass --maxtext-model NAME (one of "
                            f"{', '.join(sorted(c.model for c in options))}, with its size: the name MaxText was run with)")
        return options[0]


def _conventions(name: str, entry: dict, source: str) -> tuple[Conventions, tuple[str, ...]]:
    unknown = sorted(set(entry) - MODEL_KEYS)
    if unknown:
        raise MappingError(f"{source}: [maxtext.models.\"{name}\"] has unknown key '{unknown[0]}' (keys: "
                           f"{', '.join(sorted(MODEL_KEYS))})")
    rope = entry.get("rope", "half")
    scale = entry.get("query_scale")
    emb = entry.get("embedding_scale")
    if rope not in ("half", "interleaved") or (scale and scale not in QUERY_SCALES) or \
            (emb and emb not in EMBEDDING_SCALES):
        raise MappingError(f"{source}: [maxtext.models.\"{name}\"]: rope is half or interleaved, query_scale one of "
                           f"{QUERY_SCALES}, embedding_scale one of {EMBEDDING_SCALES}")
    vocab = entry.get("vocab")
    if vocab is not None and (not isinstance(vocab, list) or len(vocab) != 2
                              or not all(isinstance(v, int) and v > 0 for v in vocab)):
        raise MappingError(f"{source}: [maxtext.models.\"{name}\"] vocab is [HF vocab, MaxText vocab_size]")
    return (Conventions(name, rope, scale, float(entry.get("norm_offset", 0.0)), emb,
                        tuple(vocab) if vocab else None),
            tuple(entry.get("architectures", ())))


def parse_table(data: dict, family: str, source: str) -> MaxTextTable:
    """The ``[maxtext]`` table ``data`` of mapping ``family`` (from file ``source``)."""
    unknown = sorted(set(data) - {"stack", "models", "weights"})
    if unknown:
        raise MappingError(f"{source}: [maxtext] has unknown key '{unknown[0]}' (keys: models, stack, weights)")
    stack = data.get("stack", "layers")
    if stack not in STACKS:
        raise MappingError(f"{source}: [maxtext] stack = '{stack}': one of {', '.join(STACKS)}")
    models, archs = {}, {}
    for name, entry in data.get("models", {}).items():
        models[name], archs[name] = _conventions(name, entry, source)
    if not models:
        raise MappingError(f"{source}: [maxtext] names no MaxText model ([maxtext.models.\"NAME\"])")
    weights = data.get("weights", {})
    if not all(isinstance(v, str) for v in weights.values()):
        raise MappingError(f"{source}: [maxtext.weights] maps each HF name template to a MaxText name (a string)")
    return MaxTextTable(family, stack, dict(weights), models, archs)


def family_table(family) -> MaxTextTable:
    """The ``[maxtext]`` table of ``family`` (its mapping file, shipped or ``--mapping``), refused without one."""
    from reshard.mapping.shipped import shipped_mapping_text

    source = family.source
    try:
        if source.startswith("mappings/"):
            text = shipped_mapping_text(source[len("mappings/"):-len(".toml")])
        else:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        data = tomllib.loads(text).get("maxtext")
    except (OSError, tomllib.TOMLDecodeError, MappingError):
        data = None
    if not data:
        raise PlanError(f"mapping '{family.name}' has no [maxtext] table: MaxText checkpoints of this family are not "
                        "supported (families: Llama 2/3/3.1, Mistral, Mixtral, Qwen3, Qwen3-MoE, Gemma 1/2/3, "
                        "DeepSeek-V3)")
    return parse_table(data, family.name, source)


@dataclass(frozen=True)
class Place:
    """Where one HF layer's weight lives: the leaf, and its index along the layer axis (None: unstacked)."""

    leaf: str
    index: int | None
    stacked: int  # how many layers the leaf stacks (0 when unstacked)


def place(table: MaxTextTable, template: str, layer: int | None, model, scan: bool) -> Place:
    """The leaf holding HF weight ``template`` of ``layer`` (None: a weight outside the layers) in a checkpoint
    of ``model`` (the canonical model: its layer count and MoE layers), scanned or not (section 3)."""
    sub = table.weights[template]
    if layer is None:
        return Place(PREFIX + sub, None, 0)
    n = model.num_layers
    stack = table.stack
    if stack == "pairs":
        sub = sub.replace("{s}", "local" if layer % 2 == 0 else "global")
        i, count, base = layer // 2, n // 2, "decoder.layers"
    elif stack == "pattern6":
        full = 6 * (n // 6)
        if not scan:
            i, count, base = layer, n, "decoder.layers"
        elif layer < full:
            return Place(f"{PREFIX}decoder.layers.layers_{layer % 6}.{sub}", layer // 6, n // 6)
        else:
            return Place(f"{PREFIX}decoder.layers_remainder.layers_{layer - full}.{sub}", None, 0)
    elif stack == "dense_moe":
        sparse = set(model.sparse_layers)
        group = sorted(sparse) if layer in sparse else [k for k in range(n) if k not in sparse]
        base = "decoder.moe_layers" if layer in sparse else "decoder.dense_layers"
        i, count = group.index(layer), len(group)
    else:
        i, count, base = layer, n, "decoder.layers"
    if scan:
        return Place(f"{PREFIX}{base}.{sub}", i, count)
    return Place(f"{PREFIX}{base}_{i}.{sub}", None, 0)


def query_factor(conv: Conventions, config: dict, head_dim: int) -> float | None:
    """The float32 factor MaxText's query kernel carries (1/sqrt of head_dim or of query_pre_attn_scalar)."""
    if conv.query_scale is None:
        return None
    base = head_dim
    if conv.query_scale == "query_pre_attn_scalar":
        base = config.get("query_pre_attn_scalar") or head_dim
    return float(base)


def embedding_factor(conv: Conventions, hidden: int) -> float | None:
    """sqrt(H) as the converter rounds it: float32 (Gemma 1/2) or bfloat16 (Gemma 3)."""
    if conv.embedding_scale is None:
        return None
    value = math.sqrt(hidden)
    if conv.embedding_scale == "bf16_sqrt_hidden":
        import torch

        return float(torch.tensor(value, dtype=torch.float32).to(torch.bfloat16).float())
    return value


def maxtext_vocab(conv: Conventions, hf_vocab: int, requested: int | None, lossy: bool) -> int:
    """MaxText's ``vocab_size`` for a model of ``hf_vocab`` rows (section 4.5): ``requested``
    (``--maxtext-vocab-size``), else the model name's (Gemma 1/2: 256000 -> 256128, Gemma 3: 262208 -> 262144) where
    the HF vocab is the released one, else the HF vocab. Fewer rows than HF's drop tokens: refused unless
    ``lossy`` (``--allow-lossy-config vocab``)."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise PlanError(f"--maxtext-vocab-size {requested}: a whole number of rows, at least 1")
    size = requested if requested is not None else conv.vocab[1] if conv.vocab and conv.vocab[0] == hf_vocab \
        else hf_vocab
    if size < hf_vocab and not lossy:
        why = "--maxtext-vocab-size" if requested is not None else f"MaxText's {conv.model} vocab_size"
        raise PlanError(f"{why} {size} is smaller than the model's vocab {hf_vocab}: writing it drops the embedding "
                        f"rows of tokens {size}..{hf_vocab - 1} (as MaxText's to_maxtext truncates); pass "
                        "--allow-lossy-config vocab to write it anyway, or --maxtext-vocab-size "
                        f"{hf_vocab} to keep every row")
    return size
