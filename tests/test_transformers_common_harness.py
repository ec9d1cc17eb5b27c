"""The opt-in harness tests/transformers_common/ (transformers' own common tests on the Performer classes) imports
and skips cleanly in the normal suite, where HF_PERFORMER_TRANSFORMERS_TESTS is not set."""

import importlib.util
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "transformers_common" / "test_performer_common.py"


def _import_harness():
    spec = importlib.util.spec_from_file_location("performer_common_harness_under_test", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_harness_skips_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv("HF_PERFORMER_TRANSFORMERS_TESTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="HF_PERFORMER_TRANSFORMERS_TESTS=DEST/tests"):
        _import_harness()


def test_harness_names_the_script_when_the_folder_is_wrong(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PERFORMER_TRANSFORMERS_TESTS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="get_transformers_tests.sh"):
        _import_harness()
