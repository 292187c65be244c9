"""Where a pretrained model comes from: a folder written by ``save_pretrained``, a GGUF file (read by transformers
and dequantized into an ordinary float32 model), or a Hub id; and failing fast when a Hub id is used without
network (the hub clients otherwise retry for a minute)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Dict, Optional, Tuple
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


GGUF = ".gguf"


def is_gguf(name: str) -> bool:
    return str(name).lower().endswith(GGUF)


def source(name: str) -> Tuple[str, Dict[str, Any]]:
    """(what to pass ``from_pretrained``, the keywords that go with it): a GGUF file is read from its folder with
    ``gguf_file=``, as transformers reads it; anything else is passed on as it is."""
    if is_gguf(name):
        path = Path(name)
        return str(path.parent), {"gguf_file": path.name}
    return name, {}


def from_pretrained(auto, name: str, **kwargs):
    """``auto.from_pretrained(name, **kwargs)`` for a config, tokenizer or model class, ``name`` a folder, Hub id
    or GGUF file. A GGUF model's quantized weights are dequantized to float32 and the model is left an ordinary
    one (no quantizer: ``save_pretrained`` writes it, the optimizer trains it)."""
    path, extra = source(name)
    if extra and hasattr(auto, "from_config"):  # a model class (configs and tokenizers have no from_config)
        import torch

        extra["dtype"] = torch.float32
    loaded = auto.from_pretrained(path, **extra, **kwargs)
    if extra and getattr(loaded, "hf_quantizer", None) is not None:
        # transformers marks a GGUF-loaded model quantized and refuses to save it, though its weights are
        # already plain float32 tensors: nothing quantized is left to keep.
        loaded.hf_quantizer = None
        loaded.is_quantized = False
        if hasattr(loaded.config, "quantization_config"):
            del loaded.config.quantization_config
    return loaded


def check_model_path(name: str, key: str = "model.name_or_path") -> None:
    """Fail fast on a model (or tokenizer, ``key`` model.tokenizer) that cannot be found, before any data work."""
    marker = "tokenizer_config.json" if key == "model.tokenizer" else "config.json"
    if is_gguf(name):
        if not Path(name).is_file():
            raise UserError(f"{key}: GGUF file {name} does not exist (relative paths start at {Path.cwd()})")
        return
    if Path(name).exists():
        if not (Path(name) / marker).is_file():
            raise UserError(f"{key}: folder {name} has no {marker}; point it at a folder written by save_pretrained")
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{key}: folder {name} does not exist (relative paths start at {Path.cwd()})")
    require_hub(key, name)
