"""torch.distributed.checkpoint (DCP) folders as Megatron-Core's ``torch_dist`` format writes them: where their
reader and writer live, re-exported.

Layout: a ``.metadata`` index (a pickle of torch's ``Metadata``: per key its dtype, global shape and chunks, and
per chunk its ``*.distcp`` file, offset and length) read by :mod:`reshard.io.dcp_metadata` and written by
:mod:`reshard.io.dcp_metadata_write`; ``*.distcp`` data files, ``torch.save`` archives laid end to end, one per
chunk, read by :mod:`reshard.io.distcp_read` and written by :mod:`reshard.io.distcp_write`.
"""

from reshard.io.dcp_metadata import DcpChunk, DcpTensor, read_metadata
from reshard.io.dcp_metadata_write import metadata_pickle
from reshard.io.distcp_read import DistcpFile, chunk_data_offset
from reshard.io.distcp_write import DistcpWriter, written_chunks

__all__ = ["DcpChunk", "DcpTensor", "DistcpFile", "DistcpWriter", "chunk_data_offset", "metadata_pickle",
           "read_metadata", "written_chunks"]
