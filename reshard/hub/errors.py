"""huggingface_hub's exceptions as one-line ReshardErrors that name the fix (exit code 2, like all bad input)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from reshard.errors import ReshardError


class HubError(ReshardError):
    """The Hub refused a request, could not be reached, or the local cache lacks what is needed."""


@dataclass(frozen=True)
class Upload:
    """A push in progress: the complete folder it uploads and the ``reshard push ...`` command that retries it."""

    folder: str
    retry: str


def _cache_hint() -> str:
    from huggingface_hub import constants

    return f"cache: {constants.HF_HUB_CACHE}"


def _upload_failed(reason: str, upload: Upload) -> HubError:
    return HubError(f"{reason}; {upload.folder} is complete and kept: retry with `{upload.retry}`")


def translate(exc: BaseException, what: str, revision: str | None, upload: Upload | None = None) -> HubError | None:
    """The HubError for ``exc`` raised while working on ``what`` (a repo id), or None if it is not a Hub error;
    ``upload``: a push, whose network, offline and server errors name the command that retries it."""
    import httpx2
    from huggingface_hub import constants, errors

    rev = revision or "main"
    if isinstance(exc, errors.GatedRepoError):
        return HubError(f"{what} is gated: accept its conditions on the Hub and use a token with access "
                        "(HF_TOKEN or `hf auth login`)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"revision '{rev}' does not exist in {what}: check the branch, tag or commit name")
    if isinstance(exc, errors.RepositoryNotFoundError):
        status = exc.response.status_code if exc.response is not None else 404
        return HubError(f"repository {what} not found or not accessible (HTTP {status}): check the name; for a "
                        "private repo set HF_TOKEN or run `hf auth login`")
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return HubError(f"a file is missing in {what}@{rev} (HTTP 404): {str(exc).splitlines()[-1]}")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            return HubError(f"the Hub rejected the token for {what} (HTTP 401): set a valid HF_TOKEN or run "
                            "`hf auth login`")
        if status == 403:
            return HubError(f"permission denied on {what} (HTTP 403): use a token with write access to its "
                            "namespace (HF_TOKEN or `hf auth login`)")
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if upload is not None and (status is None or status == 429 or status >= 500):
            return _upload_failed(f"the Hub answered HTTP {status} while uploading to {what}: {first}", upload)
        return HubError(f"the Hub answered HTTP {status} for {what}: {first}")
    offline = constants.is_offline_mode()
    if upload is not None and isinstance(exc, errors.OfflineModeIsEnabled):
        return _upload_failed(f"HF_HUB_OFFLINE=1 forbids uploading to {what}: unset HF_HUB_OFFLINE", upload)
    if upload is not None and isinstance(exc, (httpx2.TransportError, ConnectionError)):
        return _upload_failed(f"cannot reach the Hub at {constants.ENDPOINT} to upload to {what} "
                              f"({type(exc).__name__}): check the network or HF_ENDPOINT", upload)
    if isinstance(exc, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError, errors.RevisionResolutionError,
                        errors.CachedRepoTreeNotFoundError)) and offline:
        return HubError(f"{what}@{rev} is not (completely) in the local cache and HF_HUB_OFFLINE=1 forbids "
                        f"downloading: unset HF_HUB_OFFLINE or run `reshard pull {what}` online first ({_cache_hint()})")
    if isinstance(exc, (httpx2.TransportError, errors.LocalEntryNotFoundError, errors.RevisionResolutionError,
                        errors.CachedRepoTreeNotFoundError, ConnectionError)):
        return HubError(f"cannot reach the Hub at {constants.ENDPOINT} for {what} ({type(exc).__name__}) and the "
                        "files are not in the local cache: check the network or HF_ENDPOINT; with a filled cache, "
                        f"HF_HUB_OFFLINE=1 works without a network ({_cache_hint()})")
    return None


@contextlib.contextmanager
def hub_errors(what: str, revision: str | None = None, upload: Upload | None = None):
    """Re-raise huggingface_hub and network errors inside the block as one-line HubErrors."""
    try:
        yield
    except ReshardError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated or re-raised unchanged
        mapped = translate(exc, what, revision, upload)
        if mapped is None:
            raise
        raise mapped from exc
