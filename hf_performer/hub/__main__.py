"""``python -m hf_performer.hub push FOLDER REPO_ID ...`` / ``... card FOLDER``: the two verbs alone."""

import sys

from . import main

sys.exit(main())
