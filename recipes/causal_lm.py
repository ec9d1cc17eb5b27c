"""Fine-tune a causal LM with FAVOR+ attention (or a softmax baseline) on raw text or WikiText, and report its
perplexity with the fixed sliding-window protocol of :mod:`hf_performer.tasks.evaluation`.

    accelerate launch recipes/causal_lm.py --model MODEL --train-file train.txt --validation-file valid.txt \
        --output-dir OUT [options]
    python recipes/causal_lm.py --help

Everything is implemented in :mod:`hf_performer.recipes.train`; see recipes/README.md for complete commands.
"""

import sys

from hf_performer.recipes.train import main


if __name__ == "__main__":
    sys.exit(main("causal-lm"))
