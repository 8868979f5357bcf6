"""Pull: resolve the revision, list the repo, pick the files a conversion needs, download them through the
huggingface_hub cache (interrupted downloads resume from their ``.incomplete`` blobs). Works offline from the cache."""

from __future__ import annotations

from dataclasses import dataclass

from reshard.hub.refs import HubRef
from reshard.hub.errors import hub_errors
from reshard.hub.selection import select_files
from reshard.layouts.base import Options, Source


@dataclass
class Pulled:
    path: str  # the local snapshot folder (or --local-dir)
    commit: str
    files: list[str]
    nbytes: int


def repo_listing(api, ref: HubRef, local_dir: str | None = None) -> tuple[str, dict[str, int]]:
    """(commit sha, {path: size}) of ``ref``. The listing of a commit never changes: the cached one is used when
    present (no request, works offline), else the Hub's."""
    from huggingface_hub import RepoFile, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    revision = api.resolve_revision(ref.repo_id, revision=ref.revision)
    try:
        tree = get_cached_repo_tree(ref.repo_id, revision=revision.resolved, local_dir=local_dir)
    except CachedRepoTreeNotFoundError:
        tree = [f for f in api.list_repo_tree(ref.repo_id, revision=revision.resolved, recursive=True)
                if isinstance(f, RepoFile)]
    return revision.resolved, {f.path: f.size for f in tree}


def needed_files(api, ref: HubRef, commit: str, sizes: dict[str, int], include: tuple[str, ...] = (),
                 local_dir: str | None = None) -> list[str]:
    """The files to download; the layout may read small files (the safetensors index to know which shards it
    names, a Megatron tracker to know the iteration) through the cache."""
    from huggingface_hub import hf_hub_download

    def read_text(name: str) -> str:
        with open(hf_hub_download(ref.repo_id, name, revision=commit, local_dir=local_dir)) as f:
            return f.read()

    return select_files(sorted(sizes), include, read_text)


def pull(ref: HubRef, local_dir: str | None = None, include: tuple[str, ...] = ()) -> Pulled:
    """Download what a conversion of ``ref`` needs; returns where it is."""
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi()
    with hub_errors(ref.repo_id, ref.revision):
        commit, sizes = repo_listing(api, ref, local_dir)
        files = needed_files(api, ref, commit, sizes, include, local_dir)
        path = snapshot_download(ref.repo_id, revision=commit, allow_patterns=files, local_dir=local_dir)
    return Pulled(path, commit, files, sum(sizes[f] for f in files))


def open_snapshot(ref: HubRef, opts: Options) -> Source:
    """Pull ``ref`` into the cache (no-op when cached) and open the snapshot; records the source in ``info``."""
    from reshard.layouts import open_checkpoint

    pulled = pull(ref)
    source = open_checkpoint(pulled.path, opts)
    source.info["hub"] = {"repo": ref.repo_id, "revision": ref.revision or "main", "commit": pulled.commit}
    return source
