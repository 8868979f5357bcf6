"""torch globals by name, so that rank files can be written without importing torch."""

from __future__ import annotations

# safetensors dtype -> torch storage class written in a checkpoint's persistent ids
STORAGE_TYPES = {"F64": "DoubleStorage", "F32": "FloatStorage", "F16": "HalfStorage", "BF16": "BFloat16Storage",
                 "I64": "LongStorage", "I32": "IntStorage", "I16": "ShortStorage", "I8": "CharStorage",
                 "U8": "ByteStorage", "BOOL": "BoolStorage"}


class TorchGlobal:
    """A global (``module.name``) written into a pickle by name, without importing it: ``torch.bfloat16``,
    ``torch._utils._rebuild_tensor_v2``, storage types. Callable only so that pickle accepts it in a reduce.
    ``str()`` gives ``module.name`` (``torch.bfloat16``, as ``str(torch.bfloat16)`` does)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):
        raise TypeError(f"{self.module}.{self.name} is a pickle stand-in")

    def __eq__(self, other):
        return isinstance(other, TorchGlobal) and (self.module, self.name) == (other.module, other.name)

    def __hash__(self):
        return hash((self.module, self.name))

    def __str__(self):
        return f"{self.module}.{self.name}"

    __repr__ = __str__
