"""Layouts: one module per checkpoint layout (hf, megatron, vllm), each a :class:`Layout` registered by name.

``get_layout(name)``, ``layout_names()``, ``detect(path)`` and ``open_checkpoint(path)`` come from
:mod:`reshard.layouts.registry`; ``register_layout`` adds one (see its module docstring for plug-ins).
"""

from reshard.layouts.base import Layout, Options, Source, TargetPlan, TargetSpec
from reshard.layouts.registry import (ENTRY_POINT_GROUP, detect, detect_in, get_layout, layout_names,
                                      open_checkpoint, register_layout, unregister_layout)

__all__ = ["Layout", "Options", "Source", "TargetPlan", "TargetSpec", "ENTRY_POINT_GROUP", "detect", "detect_in",
           "get_layout", "layout_names", "open_checkpoint", "register_layout", "unregister_layout"]
