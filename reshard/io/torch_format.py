"""torch's zip checkpoint format (``torch.save`` since 1.6): where its reader and writer live, re-exported.

Layout: an uncompressed zip whose records are ``<prefix>/data.pkl`` (the pickled object, tensors as persistent
ids ``('storage', StorageType, key, location, numel)``), ``byteorder``, one ``data/<key>`` record per storage
(64-byte aligned), ``version`` and ``.data/serialization_id``.

Reading (:mod:`reshard.io.torch_read`) never runs pickled code. Writing: ``data.pkl`` in
:mod:`reshard.io.torch_pickle`, the zip records in :mod:`reshard.io.torch_zip`, whole archives and the streaming
writer in :mod:`reshard.io.torch_write`.
"""

from reshard.io.torch_pickle import _Pickler, pickled, tensor_ref, torch_dtype_global
from reshard.io.torch_read import (
    MegatronEnum,
    TorchFile,
    _import_torch,
    allowed_globals,
    flatten_tensors,
    load_structure,
)
from reshard.io.torch_write import TensorSlot, TorchZipWriter, object_archive
from reshard.io.torch_zip import ZipRecords, crc32

__all__ = ["MegatronEnum", "TensorSlot", "TorchFile", "TorchZipWriter", "ZipRecords", "_Pickler", "_import_torch",
           "allowed_globals", "crc32", "flatten_tensors", "load_structure", "object_archive", "pickled", "tensor_ref",
           "torch_dtype_global"]
