"""A vision-language model's config inside reshard: config.json nests the language model in ``text_config``; reshard
reads the *flat view* (:func:`flat_view`: the text keys at the top, the VLM's own top-level keys beside them, the
source's nested form kept under :data:`NESTED`) and writes config.json back in the source's shape (:func:`nested`).
"""

from __future__ import annotations

import copy

from reshard.mapping.defaults import NESTED

# NESTED (defaults.py): where the source's nested config.json is kept inside a flat view (never written out:
# :func:`nested`).
#: Top-level keys of a VLM config that stay the VLM's own when the text config has them too.
VLM_OWN = ("architectures", "model_type")


def flat_view(config: dict) -> dict:
    """A VLM config.json as reshard reads it: ``text_config``'s keys at the top (the text family's keys), the
    VLM's ``architectures``, ``model_type`` and top-level ``tie_word_embeddings`` over them, the other top-level
    keys (``vision_config``, token ids) beside them, and the nested original under :data:`NESTED`. A config
    without ``text_config`` (old flat Qwen2.5-VL configs) or already flat is returned as it is."""
    text = config.get("text_config")
    if NESTED in config or not isinstance(text, dict):
        return dict(config)
    flat = {k: v for k, v in text.items() if k not in VLM_OWN}
    flat.update({k: v for k, v in config.items() if k != "text_config" and (k not in text or k in VLM_OWN
                                                                            or k == "tie_word_embeddings")})
    flat[NESTED] = copy.deepcopy(config)
    return flat


def nested(config: dict) -> dict:
    """config.json in the source's shape from a flat view (:func:`flat_view`): each key goes back where it came
    from (a key both levels had goes to the level the flat view read it from, and to the other level too when
    the two held the same value), new keys into ``text_config``; a key the writer removed is removed."""
    if NESTED not in config:
        return config
    base = config[NESTED]
    text, top = dict(base["text_config"]), {k: v for k, v in base.items() if k != "text_config"}
    flat = {k: v for k, v in config.items() if k != NESTED}
    for table in (text, top):
        for key in [k for k in table if k not in flat and k not in VLM_OWN]:
            del table[key]
    for key, value in flat.items():
        in_top, in_text = key in top, key in base["text_config"]
        from_top = in_top and (not in_text or key in VLM_OWN or key == "tie_word_embeddings")
        mirrored = in_top and in_text and base["text_config"][key] == base[key]
        if from_top or not in_text and in_top:
            top[key] = value
            if in_text and mirrored and key not in VLM_OWN:
                text[key] = value
        elif in_text:
            text[key] = value
            if mirrored:
                top[key] = value
        else:
            text[key] = value
    top["text_config"] = text
    return {k: top[k] for k in sorted(top)}
