"""Fine-tune a Performer (FAVOR+) model, or a softmax baseline, on a GLUE task or IMDB.

    accelerate launch recipes/text_classification.py --model MODEL --task sst2 --output-dir OUT [options]
    python recipes/text_classification.py --help

Everything is implemented in :mod:`hf_performer.recipes.train`; see recipes/README.md for complete commands.
"""

import sys

from hf_performer.recipes.train import main


if __name__ == "__main__":
    sys.exit(main("text-classification"))
