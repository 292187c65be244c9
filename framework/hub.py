"""Fail fast when a Hub name is used without network: the hub clients otherwise retry for a minute."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from huggingface_hub import constants

from framework.errors import UserError


def hub_unreachable() -> Optional[str]:
    """Why the Hub cannot be reached ("the Hub (host) is unreachable (reason)"), or None when it can, or when
    HF_HUB_OFFLINE is set: the clients then read only their local cache, and fail fast when it lacks the files."""
    if constants.HF_HUB_OFFLINE:
        return None
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
    except OSError as e:
        return f"the Hub ({url.hostname}) is unreachable ({e.strerror or e})"
    return None


def require_hub(key: str, name: str) -> None:
    """Raise a UserError naming ``key`` when ``name`` would need the Hub and the Hub cannot be reached."""
    hint = ("use data.train_file (and data.eval_file) with local files instead" if key.endswith(".dataset") else
            "point it at a local folder holding config.json, the weights and the tokenizer")
    reason = hub_unreachable()
    if reason:
        raise UserError(f"{key}: '{name}' is not a local path and {reason}; {hint} (or set HF_HUB_OFFLINE=1 to use "
                        "the Hugging Face cache)")


def check_model_path(name: str, key: str = "model.name_or_path") -> None:
    """Fail fast on a model (or tokenizer, ``key`` model.tokenizer) that cannot be found, before any data work."""
    marker = "tokenizer_config.json" if key == "model.tokenizer" else "config.json"
    if Path(name).exists():
        if not (Path(name) / marker).is_file():
            raise UserError(f"{key}: folder {name} has no {marker}; point it at a folder written by save_pretrained")
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{key}: folder {name} does not exist (relative paths start at {Path.cwd()})")
    require_hub(key, name)
