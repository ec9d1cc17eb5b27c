"""Uploading a Performer model folder to the Hugging Face Hub (``hf-performer push``).

:func:`push_folder` validates (:func:`~hf_performer.hub.folder.validate_folder`), then
``HfApi.create_repo(exist_ok=True)`` (+ ``create_branch`` for a ``revision``) and ``HfApi.upload_folder``;
``dry_run=True`` only lists what would be uploaded. A recipe's ``checkpoints/`` is left out unless
``include_checkpoints=True``. The token comes from ``token=``, else the usual places (``HF_TOKEN``, the cached
``hf auth login`` token); the endpoint from ``endpoint=``, else ``HF_ENDPOINT`` (read at call time), else
huggingface.co. Failures (``HF_HUB_OFFLINE`` set, the Hub unreachable, a refused token) are a :class:`PushError` of
one line saying what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from huggingface_hub import HfApi
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import get_token

from .folder import (
    _HUB_ID,
    UploadFile,
    _human_bytes,
    _ignore_patterns,
    validate_folder,
)


class PushError(RuntimeError):
    """The upload could not be started or failed (no token, bad repo id or revision, Hub error)."""


@dataclass
class PushResult:
    """What :func:`push_folder` sent (or would send, with ``dry_run``)."""

    repo_id: str
    revision: str | None
    files: list[UploadFile]
    dry_run: bool
    repo_url: str | None = None
    commit_url: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def format_listing(self) -> str:
        """The file list as a table (path, size), with the total."""
        width = max([len(f.path) for f in self.files] + [4])
        lines = [f"  {f.path:<{width}}  {_human_bytes(f.size):>10}  ({f.size} bytes)" for f in self.files]
        lines.append(f"  {len(self.files)} files, {_human_bytes(self.total_bytes)} ({self.total_bytes} bytes)")
        return "\n".join(lines)


def _check_revision(revision: str | None) -> bool:
    """Whether ``revision`` is a branch to create if needed (``False`` for ``None``, ``main`` and PR refs)."""
    if revision is None or revision == "main" or revision.startswith("refs/pr/"):
        return False
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        raise PushError(f"revision {revision!r} is a commit id: uploads go to a branch; give a branch name")
    if revision.startswith("refs/") or not re.fullmatch(r"[\w.\-/]+", revision) or ".." in revision:
        raise PushError(f"revision {revision!r} is not a valid branch name")
    return True


_OFFLINE_ADVICE = (
    "HF_HUB_OFFLINE is set, so huggingface_hub sends nothing: unset it to upload "
    "(`env -u HF_HUB_OFFLINE hf-performer push ...`); --dry-run lists the files without the network"
)


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _hub_refusal(repo_id: str, error: HfHubHTTPError) -> str:
    """One line for an HTTP error of the Hub: the status and reason, and what to do about a token problem."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    reason = _first_line(error)
    if status in (401, 403):
        return (
            f"the Hub refused the upload to {repo_id} ({reason}): the token is invalid or cannot write to "
            f"{repo_id.split('/')[0]}; log in with `hf auth login` or pass --token with a write token"
        )
    return f"the Hub refused the upload to {repo_id}: {reason}"


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    include_checkpoints: bool = False,
    without_tokenizer: bool = False,
) -> PushResult:
    """Validate ``folder`` and upload it to the Hub model repository ``repo_id``.

    Args:
        folder: a Performer model folder (checked by :func:`validate_folder` first; nothing is sent if it fails).
        repo_id: ``namespace/name``.
        private: create the repository private (an existing repository keeps its visibility). Without it the
            Hub's default applies (public, unless the organisation defaults to private).
        revision: branch to upload to; created from ``main`` when it does not exist (``refs/pr/N`` is used as is).
        dry_run: only list what would be uploaded: no network, no token needed.
        token: a Hub token; default: ``HF_TOKEN`` or the cached login (``hf auth login``).
        commit_message: default "Upload Performer model with hf-performer".
        endpoint: the Hub's URL; default ``HF_ENDPOINT`` (read now) or https://huggingface.co.
        include_checkpoints: also upload ``checkpoints/`` (training states; left out by default).
        without_tokenizer: push a folder that has no tokenizer (:func:`validate_folder`).

    Returns:
        A :class:`PushResult` listing the files (sent, or that would be sent).

    Raises:
        FolderValidationError: the folder would not load.
        PushError: bad repo id or revision, no token, ``HF_HUB_OFFLINE`` set, the Hub unreachable or refusing the
            upload; the message is one line saying what to do.
    """
    check = validate_folder(folder, include_checkpoints=include_checkpoints, without_tokenizer=without_tokenizer)
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not _HUB_ID.match(repo_id) or ".." in repo_id:
        raise PushError(f"repo id {repo_id!r} is not of the form namespace/name")
    create_branch = _check_revision(revision)
    result = PushResult(repo_id=repo_id, revision=revision, files=check.files, dry_run=dry_run, warnings=check.warnings)
    if dry_run:
        return result

    if hub_constants.HF_HUB_OFFLINE:
        raise PushError(_OFFLINE_ADVICE)
    if token is None and get_token() is None:
        raise PushError(
            "no Hugging Face token: set HF_TOKEN, log in with `hf auth login`, or pass --token (a write token)"
        )
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        if create_branch:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(check.folder),
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload Performer model with hf-performer",
            ignore_patterns=_ignore_patterns(include_checkpoints),
        )
    except OfflineModeIsEnabled:
        raise PushError(_OFFLINE_ADVICE) from None
    except HfHubHTTPError as error:
        raise PushError(_hub_refusal(repo_id, error)) from error
    except Exception as error:  # the transport's errors (refused, reset, DNS, timeout) have no common base here
        raise PushError(
            f"could not reach the Hub at {endpoint or hub_constants.ENDPOINT} to upload {repo_id}: "
            f"{_first_line(error)} ({type(error).__name__}); check the network (and HF_ENDPOINT, proxies), then retry"
        ) from error
    result.repo_url = str(repo_url)
    result.commit_url = getattr(info, "commit_url", None)
    return result
