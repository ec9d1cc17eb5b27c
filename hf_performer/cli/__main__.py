"""``python -m hf_performer.cli VERB ...``: the same as ``hf-performer VERB ...``."""

import sys

from . import main

sys.exit(main())
