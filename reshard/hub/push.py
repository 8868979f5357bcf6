"""Push a finished conversion to the Hub: refuse incomplete output, create the repo or branch when missing, commit
every file plus ``reshard.json`` and the model card with huggingface_hub (unchanged files are skipped by it; an
unchanged folder makes no commit). A branch this push creates starts as a copy of main, so files it inherited
that are not part of the checkpoint are deleted in the same commit (README.md and .gitattributes are kept); on a
branch that already existed nothing is deleted unless ``replace`` is asked for, and the files left are reported."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field

from reshard.errors import CheckpointError, ReshardError
from reshard.hub.refs import parse_repo_id
from reshard.hub.errors import Upload, hub_errors
from reshard.hub.manifest import CARD, MANIFEST, build_manifest, model_card

STAGING_MARK = ".reshard-partial-"


@dataclass
class Pushed:
    repo_id: str
    revision: str
    commit: str
    changed: bool
    url: str
    pr_url: str | None = None
    others: list[str] = field(default_factory=list)  # files of the branch that are not part of this checkpoint


def checked_output(folder: str) -> tuple[str, dict, list[str]]:
    """(layout, degrees, files relative to ``folder``) of a complete reshard output; refuses anything partial."""
    from reshard.layouts.registry import get_layout, open_checkpoint

    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is not a folder: pass the converted checkpoint folder")
    if STAGING_MARK in os.path.basename(os.path.abspath(folder)):
        raise CheckpointError(f"{folder} is a staging folder of an unfinished conversion: run the conversion again")
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != ".cache")
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if name.endswith(".partial") or STAGING_MARK in rel:
                raise CheckpointError(f"{folder} holds the unfinished file {rel}: the conversion did not complete; "
                                      "run it again before pushing")
            files.append(rel)
    with open_checkpoint(folder) as source:  # detects the layout and checks every tensor is present
        layout, degrees = source.layout, dict(source.degrees)
    markers = get_layout(layout).completion_markers  # a file a complete output has (written last by reshard)
    if markers and not any(os.path.isfile(os.path.join(folder, m)) for m in markers):
        raise CheckpointError(f"{folder} lacks {' or '.join(markers)}, which a complete {layout} output has: "
                              "the conversion did not complete; run it again before pushing")
    return layout, degrees, files


def retry_command(folder: str, repo: str, *, revision: str | None = None, private: bool = False,
                  create_pr: bool = False, commit_message: str | None = None, replace: bool = False) -> str:
    """The ``reshard push`` command line that does what :func:`push` was asked to, shell-quoted."""
    args = ["reshard", "push", folder, repo, *(["--revision", revision] if revision else []),
            *(["--private"] if private else []), *(["--create-pr"] if create_pr else []),
            *(["--commit-message", commit_message] if commit_message else []), *(["--replace"] if replace else [])]
    return shlex.join(args)


def push(folder: str, repo: str, *, revision: str | None = None, private: bool = False, create_pr: bool = False,
         commit_message: str | None = None, replace: bool = False) -> Pushed:
    """Upload ``folder`` to ``repo`` (ORG/NAME) at branch ``revision`` (default: the default branch). A failed
    upload's error names the ``reshard push`` command that retries it."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RevisionNotFoundError

    ref = parse_repo_id(repo, revision)
    if create_pr and ref.revision not in (None, "main"):
        raise ReshardError("--create-pr opens a pull request against the default branch: drop --revision or "
                           "--create-pr")
    layout, degrees, files = checked_output(folder)
    content = [f for f in files if f not in (MANIFEST, CARD)]
    manifest = build_manifest(folder, content, layout, degrees)
    branch = ref.revision or "main"
    api = HfApi()
    upload = Upload(folder, retry_command(folder, repo, revision=revision, private=private, create_pr=create_pr,
                                          commit_message=commit_message, replace=replace))
    with hub_errors(ref.repo_id, ref.revision, upload):
        api.create_repo(ref.repo_id, private=private, exist_ok=True)
        created = False
        if branch != "main":
            try:
                api.repo_info(ref.repo_id, revision=branch)
            except RevisionNotFoundError:
                api.create_branch(ref.repo_id, branch=branch, exist_ok=True)
                created = True
        before = api.repo_info(ref.repo_id, revision=branch).sha
        card = None
        if CARD in files:
            with open(os.path.join(folder, CARD)) as f:
                card = f.read()
        else:
            try:
                with open(hf_hub_download(ref.repo_id, CARD, revision=before)) as f:
                    card = f.read()
            except RemoteEntryNotFoundError:
                pass
        operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(folder, rel))
                      for rel in content]
        # a new branch (a copy of main) or --replace: the branch holds exactly this checkpoint; otherwise files of
        # another checkpoint stay where they are and are reported
        keep = set(content) | {MANIFEST, CARD, ".gitattributes"}
        others = [p for p in api.list_repo_files(ref.repo_id, revision=before) if p not in keep]
        if created or replace:
            operations += [CommitOperationDelete(path_in_repo=p) for p in others]
            others = []
        operations.append(CommitOperationAdd(
            path_in_repo=MANIFEST, path_or_fileobj=(json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()))
        operations.append(CommitOperationAdd(path_in_repo=CARD,
                                             path_or_fileobj=model_card(card, ref.repo_id, manifest).encode()))
        source = (manifest.get("source") or {}).get("repo")
        message = commit_message or (f"reshard: {layout} " + " ".join(f"{k}={v}" for k, v in sorted(degrees.items()))
                                     + (f" from {source}" if source else ""))
        info = api.create_commit(ref.repo_id, operations, commit_message=message, revision=branch,
                                 create_pr=create_pr)
    return Pushed(ref.repo_id, branch, info.oid, info.oid != before, info.commit_url, info.pr_url, others)
