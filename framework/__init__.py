"""A device-agnostic training framework on Hugging Face Accelerate: one loop for CPU, GPU and XLA.

Entry point: ``accelerate launch recipes/run.py [--config RECIPE] [KEY=VALUE ...]`` (see README.md).
"""

__version__ = "0.1.0"
