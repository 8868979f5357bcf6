"""config.json's RoPE and sliding-window spellings <-> :class:`~reshard.core.model_config.ModelConfig` (for
:mod:`.hf_config`): transformers 5's ``rope_parameters`` (also per layer type: ``full_attention`` /
``sliding_attention``) and transformers 4's ``rope_theta`` + ``rope_scaling``, the local RoPE base of sliding layers,
and the sliding window with the layers it applies to, as the family's ``[config]`` window spelling writes them; what
an architecture cannot spell is a :class:`~reshard.core.model_config.ConfigLoss`."""

from __future__ import annotations

from reshard.core.model_config import ConfigLoss, ModelConfig, normalize_scaling
from reshard.errors import CheckpointError
from reshard.layouts import phi3_rope
from reshard.mapping import Family


#: transformers 5's per-layer-type RoPE (Gemma 3): ``rope_parameters`` = {layer type: parameters}.
LAYER_TYPES = ("full_attention", "sliding_attention")


def _local_theta(config: dict, family: Family, theta: float, where: str) -> float | None:
    """The RoPE base of sliding-window layers when it differs from ``theta`` (Gemma 3), from transformers 5's
    per-layer-type ``rope_parameters`` or the family's key (``rope_local_base_freq``)."""
    params = config.get("rope_parameters")
    local = None
    if isinstance(params, dict) and set(params) <= set(LAYER_TYPES) and isinstance(params.get("sliding_attention"),
                                                                                    dict):
        sliding = params["sliding_attention"]
        if normalize_scaling(sliding) is not None:
            raise CheckpointError(f"{where}: RoPE scaling on sliding-window layers ({sliding}) is not carried yet")
        local = float(sliding.get("rope_theta", theta))
    elif family.config.rope_local_theta and config.get(family.config.rope_local_theta) is not None:
        local = float(config[family.config.rope_local_theta])
    return None if local is None or local == theta else local


def _rope(config: dict, where: str) -> tuple[float, tuple | None, float]:
    """(theta, normalized scaling, rotary fraction) from either spelling (per-layer-type parameters: the full
    attention layers')."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= set(LAYER_TYPES):
        config = dict(config, rope_parameters=params.get("full_attention") or {})
        params = config["rope_parameters"]
    scaling = config.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"{where}: rope_parameters must be an object, not {type(params).__name__}")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_scaling must be an object or null, not {type(scaling).__name__}")
    if params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        if "rope_theta" in config and "rope_theta" in params and float(config["rope_theta"]) != float(theta):
            raise CheckpointError(f"{where}: rope_theta {config['rope_theta']} and rope_parameters.rope_theta "
                                  f"{theta} disagree; keep one")
        if scaling and normalize_scaling(scaling) != normalize_scaling(params):
            raise CheckpointError(f"{where}: rope_scaling and rope_parameters disagree; keep one")
        fraction = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        return float(theta), normalize_scaling(params), float(fraction)
    return (float(config.get("rope_theta", 10000.0)), normalize_scaling(scaling),
            float(config.get("partial_rotary_factor", 1.0)))


def _window(config: dict, spelling: str, layers: int, pattern: int | None = None) \
        -> tuple[int | None, tuple[int, ...] | None]:
    """(window, windowed layers or None for all) as the architecture spells it."""
    if spelling == "none":
        return None, None
    if spelling == "all_layers":
        window = config.get("sliding_window")
        return (int(window), None) if window else (None, None)
    if spelling == "typed":
        window = config.get("sliding_window")
        types = config.get("layer_types")
        if not isinstance(types, list) or len(types) != layers:
            every = int(config.get("sliding_window_pattern") or pattern or 0)
            types = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
                     for i in range(layers)]
        windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if not window or not windowed:
            return None, None
        return int(window), None if windowed == tuple(range(layers)) else windowed
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    if not window:
        return None, None
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        start = config.get("max_window_layers", 0) or 0
        windowed = tuple(range(int(start), layers))
    if not windowed:
        return None, None
    return int(window), None if windowed == tuple(range(layers)) else windowed


def _write_rope(c: dict, meaning: ModelConfig, partial_ok: bool, loss: ConfigLoss,
                default_fraction: float = 1.0) -> None:
    """RoPE in ``c``'s spelling; the rotary fraction written when not 1, or always where the architecture's
    config class defaults to another (Nemotron's 0.5)."""
    explicit = meaning.rotary_fraction != 1.0 or default_fraction != 1.0 or "partial_rotary_factor" in c \
        or "partial_rotary_factor" in (c.get("rope_parameters") or {})  # the source spells it
    if meaning.rope_interleaved and not meaning.llama4:  # Llama 4's HF rows are Meta's (interleaved) themselves
        loss.cannot("rope_interleaved", True, "transformers rotates halves; interleaved pairs would need the q/k "
                    "rows permuted, which reshard does not do yet")
    if meaning.rotary_fraction != 1.0 and not partial_ok:
        loss.cannot("rotary_fraction", meaning.rotary_fraction, f"{meaning.architecture} rotates every head dim")
    scaling = phi3_rope.written(c, meaning)
    if "rope_parameters" in c:  # transformers 5 spelling
        params = {"rope_type": scaling.pop("rope_type", "default"), "rope_theta": meaning.rope_theta,
                  **{k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}}
        if explicit:
            params["partial_rotary_factor"] = meaning.rotary_fraction
        c["rope_parameters"] = params
        for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
            c.pop(key, None)
        return
    c["rope_theta"] = meaning.rope_theta
    if scaling and normalize_scaling(c.get("rope_scaling")) == normalize_scaling(scaling):
        pass  # the source's own spelling of the same scaling (Qwen2.5-VL's {"type": "mrope", ...}) is kept
    elif scaling:
        c["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    elif c.get("rope_scaling") is not None:
        c["rope_scaling"] = None
    if explicit:
        c["partial_rotary_factor"] = meaning.rotary_fraction
    else:
        c.pop("partial_rotary_factor", None)


def _write_local_theta(c: dict, meaning: ModelConfig, family: Family, loss: ConfigLoss, per_type: bool) -> None:
    """The sliding layers' RoPE base: in transformers 5's per-layer-type ``rope_parameters`` when the source config
    spells RoPE so (``per_type``), else under the family's key."""
    local = meaning.rope_local_theta if meaning.rope_local_theta is not None else meaning.rope_theta
    key = family.config.rope_local_theta
    if key is None:
        if meaning.rope_local_theta is not None:
            loss.cannot("rope_local_theta", meaning.rope_local_theta, f"{meaning.architecture} has one RoPE base")
        elif per_type:  # OLMo 3: per-layer-type rope_parameters with one base, kept per type
            c["rope_parameters"] = {"full_attention": c["rope_parameters"],
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        return
    if per_type:
        c["rope_parameters"] = {"full_attention": c["rope_parameters"],
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        c.pop(key, None)
    else:
        c[key] = local


def _write_window(c: dict, meaning: ModelConfig, spelling: str, loss: ConfigLoss) -> None:
    window, windowed = meaning.sliding_window, meaning.windowed_layers()
    if spelling == "none":
        if window:
            loss.cannot("sliding_window", window, f"{meaning.architecture} has no sliding window")
        return
    if spelling == "typed":
        c["sliding_window"] = window
        types = ["sliding_attention" if i in windowed else "full_attention" for i in range(meaning.layers)]
        every = c.get("sliding_window_pattern") if "layer_types" not in c else None  # Cohere2's release spelling
        if not (every and types == ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                    for i in range(meaning.layers)]):
            c["layer_types"] = types
            c.pop("sliding_window_pattern", None)
        return
    if spelling == "all_layers":
        if window and meaning.sliding_layers is not None:
            loss.cannot("sliding_layers", list(meaning.sliding_layers),
                        f"{meaning.architecture} applies its window to every layer")
        c["sliding_window"] = window
        return
    if window or "use_sliding_window" in c:
        c["use_sliding_window"] = bool(window)
    if window:
        c["sliding_window"] = window
        types = ["sliding_attention" if i in windowed else "full_attention" for i in range(meaning.layers)]
        tail = windowed == tuple(range(windowed[0], meaning.layers))
        if tail:
            c["max_window_layers"] = windowed[0]
        elif "layer_types" not in c:
            loss.cannot("sliding_layers", list(windowed), "transformers 4's max_window_layers spells only a run of "
                        "final layers (transformers 5's layer_types would, in a config that has them)")
        c["layer_types"] = types
    elif "layer_types" in c:
        c["layer_types"] = ["full_attention"] * meaning.layers
