"""Deprecated import path (one release): the recipes live in :mod:`hf_performer.recipes`.

``from hf_performer.training import train, main, build_parser`` keeps working with a ``FutureWarning``; use
``hf_performer.recipes.train`` (``train(args, loss_hooks=...)``, ``main(kind, argv)``) and
``hf_performer.recipes.arguments`` (``build_parser``).
"""

import warnings

from .recipes.arguments import KINDS, RecipeError, build_parser
from .recipes.train import main, train

warnings.warn("hf_performer.training is deprecated: import from hf_performer.recipes.train (train, main) and "
              "hf_performer.recipes.arguments (build_parser)", FutureWarning, stacklevel=2)

__all__ = ["KINDS", "RecipeError", "build_parser", "main", "train"]
