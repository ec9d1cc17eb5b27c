"""Fixtures shared by the test files."""

import pytest

_BLOCK_HF_PERFORMER = """\
import sys


class BlockHfPerformer:
    # Makes `hf_performer` unimportable, as on a machine where the package is not installed.
    def find_spec(self, name, path=None, target=None):
        if name == "hf_performer" or name.startswith("hf_performer."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked for this test)", name=name)
        return None


sys.meta_path.insert(0, BlockHfPerformer())

"""


@pytest.fixture
def block_hf_performer_source() -> str:
    """Python source that makes ``hf_performer`` unimportable in the process that runs it (put it at the top of a
    script, or in a ``sitecustomize.py`` on ``PYTHONPATH``): a user's machine where the package is not installed."""
    return _BLOCK_HF_PERFORMER
