"""Library messages that say nothing to a user of this framework, dropped where they are emitted, each by its own
text (what else those libraries say still shows). ``silence()`` installs the filters; a run calls it first.

- accelerate's "Removed shared tensor {...} while saving", at every checkpoint of a model with tied weights (an
  output layer sharing the embedding's storage): the tensor is saved once and tied again on load, as the bitwise
  resume tests of tied models show.
- bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community", when peft imports it on a CPU with
  AVX-512 bf16: it would fetch a kernel from the Hub, and falls back to its own, which QLoRA here is tested on.
- transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", which peft 0.21 triggers in every
  ``get_peft_model``: the framework never reads that property itself.
- torch.distributed.checkpoint's "torch.distributed is disabled, unavailable or uninitialized, assuming the intent
  is to save in a single process" (and load), at every checkpoint of a run of one process: that is the intent
  (framework/backend/states.py), and torch says it even when told so.
"""

from __future__ import annotations

import logging
import warnings

LOGGED = {"accelerate.utils.other": "Removed shared tensor",
          "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}
WARNED = [(FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
          (UserWarning, r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to")]


class _Dropping(logging.Filter):
    """Drops the records whose message holds ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.getMessage())


def silence() -> None:
    """Install the filters (once: a second call adds nothing)."""
    for name, text in LOGGED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Dropping) and f.text == text for f in logger.filters):
            logger.addFilter(_Dropping(text))
    for category, message in WARNED:
        warnings.filterwarnings("ignore", message=message, category=category)
