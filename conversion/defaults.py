"""The defaults and choices of the conversion verbs (``convert``, ``distill``, ``quickstart``, ``linearize``), declared
without torch: their parsers read them, so ``--help`` imports neither torch nor transformers. The modules that use
them (:mod:`.convert`, :mod:`.attention_transfer`, :mod:`.distill`) import them from here."""

DEFAULT_MAX_POSITION_EMBEDDINGS = 4096
"""Positions a shorter learned absolute table is extended to by ``hf-performer convert`` and ``quickstart``."""

TRANSFER_LOSSES = ("weights", "output", "both")
"""Losses of attention transfer: KL of the attention weights (Hedgehog), MSE of the attention outputs (LoLCATs), or
their sum."""

TRANSFER_SCHEDULES = ("constant", "cosine")
"""Learning-rate schedules of attention transfer over its steps."""

TEXT_DATA = "text"
"""``hf-performer distill --data-task`` of raw text (cut into blocks), as opposed to a task file's text columns."""
