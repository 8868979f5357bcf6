"""The ``reshard pull`` and ``reshard push`` commands (Hugging Face Hub download through the HF cache, upload with a
``reshard.json`` manifest): plain functions that :mod:`reshard.cli` registers on its app, in help order."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from reshard.cli_output import _report_push


def pull(
    repo_id: str = typer.Argument(..., help="ORG/NAME or hf://ORG/NAME[@REV]."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit (default: main)."),
    local_dir: Optional[str] = typer.Option(None, "--local-dir", help="Download into this folder, not the cache."),
    include: Optional[list[str]] = typer.Option(None, "--include", help="Also download files matching this glob."),
):
    """Download what a conversion needs (safetensors + index, config, tokenizer) through the HF cache."""
    from reshard.hub import parse_repo_id
    from reshard.hub.download import pull as run_pull

    ref = parse_repo_id(repo_id, revision)
    pulled = run_pull(ref, local_dir=local_dir, include=tuple(include or ()))
    print(f"pulled {ref} (commit {pulled.commit[:12]}): {len(pulled.files)} files, "
          f"{pulled.nbytes / 2**20:.1f} MiB", file=sys.stderr)
    print(pulled.path)



def push(
    folder: str = typer.Argument(..., help="A finished reshard output folder."),
    repo_id: str = typer.Argument(..., help="ORG/NAME (created when missing)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch to push to (created when missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repo private."),
    create_pr: bool = typer.Option(False, "--create-pr", help="Open a pull request instead of committing."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", help="Commit message."),
    replace: bool = typer.Option(False, "--replace", help="Delete files on an existing branch that are not part of "
                                 "this checkpoint (a branch the push creates is always cleaned)."),
):
    """Upload a converted checkpoint with a reshard.json manifest and a model-card section."""
    from reshard.hub.push import push as run_push

    _report_push(folder, run_push(folder, repo_id, revision=revision, private=private, create_pr=create_pr,
                                  commit_message=commit_message, replace=replace))
