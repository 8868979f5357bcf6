"""Plan from the Hub without downloading weights: safetensors headers fetched with two HTTP Range requests per
file (the 8-byte length, then the JSON header), config and index through the cache, tensors that cannot be read."""

from __future__ import annotations

import json
import struct

from reshard.errors import CheckpointError, ReshardError
from reshard.hub.refs import HubRef
from reshard.hub.download import needed_files, repo_listing
from reshard.hub.errors import hub_errors
from reshard.hub.selection import repo_layout
from reshard.io.safetensors_format import MAX_HEADER, parse_header
from reshard.io.tensorfile import TensorFile
from reshard.layouts.base import Options, Source


class RemoteTensorFile(TensorFile):
    """A safetensors file on the Hub known by its header only; reading tensors is refused."""

    format = "safetensors"

    def read(self, name, axis=0, start=0, length=None):
        raise ReshardError(f"{self.path} is remote (headers only): convert without --dry-run to download it")

    @property
    def fd(self) -> int:
        raise ReshardError(f"{self.path} is remote (headers only): convert without --dry-run to download it")


def _range(session, url: str, headers: dict, first: int, last: int) -> bytes:
    from huggingface_hub.utils import hf_raise_for_status

    response = session.get(url, headers={**headers, "Range": f"bytes={first}-{last}"}, follow_redirects=True)
    hf_raise_for_status(response)
    data = response.content
    if response.status_code != 206:  # a server that ignores Range: keep only what was asked for
        data = data[first:last + 1]
    return data


def fetch_header(ref: HubRef, commit: str, filename: str, size: int, endpoint: str) -> RemoteTensorFile:
    """Read ``filename``'s safetensors header with Range requests; no tensor byte is transferred."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    url = hf_hub_url(ref.repo_id, filename, revision=commit, endpoint=endpoint)
    session, headers = get_session(), build_hf_headers()
    where = f"{ref}/{filename}"
    head = _range(session, url, headers, 0, 7)
    if len(head) < 8:
        raise CheckpointError(f"{where}: truncated safetensors file (no header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{where}: safetensors header length {n} runs past the end of the file ({size} bytes)")
    tensors, _ = parse_header(where, _range(session, url, headers, 8, 7 + n), size)
    return RemoteTensorFile(where, tensors)


def _cached(ref: HubRef, commit: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(ref.repo_id, filename, revision=commit), str)


def open_remote(ref: HubRef, opts: Options) -> Source:
    """The canonical view of an HF-layout repo from its config and safetensors headers.

    ``info["download"]``: the files a conversion would download and the bytes not already in the cache.
    """
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    with hub_errors(ref.repo_id, ref.revision):
        commit, sizes = repo_listing(api, ref)
        layout = repo_layout(sorted(sizes), str(ref))
        if not layout.remote_headers:
            raise CheckpointError(f"{ref} holds a {layout.name} checkpoint: plans from remote headers need an "
                                  f"HF-layout repo; run `reshard pull {ref.repo_id}` and plan the local folder")
        files = needed_files(api, ref, commit, sizes)
        weights = [f for f in files if f.endswith(".safetensors")]
        if not weights or "config.json" not in files:
            raise CheckpointError(f"{ref} has no config.json and safetensors weights to plan from headers: "
                                  f"run `reshard pull {ref.repo_id}` and plan the local folder")
        with open(hf_hub_download(ref.repo_id, "config.json", revision=commit)) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{ref}/config.json: invalid JSON ({exc})") from None
        tensor_files = [fetch_header(ref, commit, name, sizes[name], api.endpoint) for name in weights]
        missing = [f for f in files if not _cached(ref, commit, f)]
    source = layout.open_headers(str(ref), config, tensor_files, opts)
    source.info["hub"] = {"repo": ref.repo_id, "revision": ref.revision or "main", "commit": commit}
    source.info["download"] = {"files": len(missing), "bytes": sum(sizes[f] for f in missing)}
    return source
