"""transformers' OWN common tests (``ModelTesterMixin``, ``GenerationTesterMixin``, ``ConfigTester``) run against the
Performer classes built from tiny BERT, GPT-2 and Llama sources (issue 16).

Opt-in: skipped unless ``HF_PERFORMER_TRANSFORMERS_TESTS`` names the ``tests/`` folder that
``tests/transformers_common/get_transformers_tests.sh DEST`` assembles (``DEST/tests``) for the installed transformers
version. transformers' files are imported from there, never copied into this repository::

    TRANSFORMERS_GIT=/path/to/transformers/.git tests/transformers_common/get_transformers_tests.sh /tmp/transformers-tests
    HF_PERFORMER_TRANSFORMERS_TESTS=/tmp/transformers-tests/tests python -m pytest -q tests/transformers_common

The model testers follow transformers' own (``BertModelTester``, ``GPT2ModelTester``, ``LlamaModelTester``): a
``get_config()`` and ``prepare_config_and_inputs_for_common()`` returning ``(config, inputs_dict)``. The generation
mixin runs only when ``tests/generation/test_utils.py`` of a transformers tag is in the folder (the sdist does not
ship it; the script reads it from TRANSFORMERS_GIT); otherwise the causal testers run the model tests only, and
``test_generation_mixin_present`` reports the skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import pytest

TESTS_ENV = "HF_PERFORMER_TRANSFORMERS_TESTS"
_tests_folder = os.environ.get(TESTS_ENV)
if not _tests_folder:
    pytest.skip(
        f"transformers' common tests are opt-in: set {TESTS_ENV}=DEST/tests after running "
        "tests/transformers_common/get_transformers_tests.sh DEST",
        allow_module_level=True,
    )

import torch  # noqa: E402
from transformers import GPTNeoXConfig  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES  # noqa: E402
from transformers.utils import logging  # noqa: E402

from hf_performer import (  # noqa: E402
    PerformerConfig,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
)
from hf_performer.cache import is_favor_cache_layer  # noqa: E402
from hf_performer.configuration_performer import PERFORMER_MODEL_TYPE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared tiny source configs
from conftest import tiny_bert_config, tiny_gpt2_config, tiny_llama_config  # noqa: E402

logging.set_verbosity_error()

TINY_GPT_NEOX = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99,
                     rotary_pct=0.5)
"""GPT-NeoX: partial rotary embeddings (half of each head: dynamic scaling needs at least 4 rotary dims), fused query_key_value, parallel residual, and the
cache under ``layer_past`` in its attention modules (issue 35)."""

TRANSFORMERS_TESTS_PACKAGE = "tests"
"""transformers' test files import each other as ``tests.exporters.test_export`` (absolute) and ``.generation...``
(relative): their folder is imported under its own name, ``tests`` (this repository's tests/ is not a package)."""


def _import_transformers_tests(folder: str):
    """Import ``folder`` (transformers' ``tests/``) as the package :data:`TRANSFORMERS_TESTS_PACKAGE` and return
    ``(test_modeling_common, test_configuration_common, generation_test_utils)``.

    Raises:
        FileNotFoundError: ``folder`` holds no ``test_modeling_common.py``.
        ImportError: another package named ``tests`` is already imported.
    """
    tests_path = Path(folder).resolve()
    if not (tests_path / "test_modeling_common.py").is_file():
        raise FileNotFoundError(
            f"{TESTS_ENV}={folder}: no test_modeling_common.py there; point it at DEST/tests made by "
            "tests/transformers_common/get_transformers_tests.sh DEST"
        )
    dependencies = tests_path.parent / "_deps"  # `parameterized`, installed there by the script
    if dependencies.is_dir() and str(dependencies) not in sys.path:
        sys.path.insert(0, str(dependencies))
    loaded = sys.modules.get(TRANSFORMERS_TESTS_PACKAGE)
    if loaded is not None and [str(tests_path)] != list(getattr(loaded, "__path__", [])):
        raise ImportError(
            f"a package named {TRANSFORMERS_TESTS_PACKAGE!r} is already imported from {list(loaded.__path__)}; "
            f"transformers' tests in {tests_path} need that name: run tests/transformers_common on its own"
        )
    if loaded is None:
        spec = importlib.util.spec_from_file_location(
            TRANSFORMERS_TESTS_PACKAGE, tests_path / "__init__.py", submodule_search_locations=[str(tests_path)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[TRANSFORMERS_TESTS_PACKAGE] = package
        spec.loader.exec_module(package)
    modeling = importlib.import_module(f"{TRANSFORMERS_TESTS_PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{TRANSFORMERS_TESTS_PACKAGE}.test_configuration_common")
    generation = importlib.import_module(f"{TRANSFORMERS_TESTS_PACKAGE}.generation.test_utils")
    return modeling, configuration, generation


_modeling_common, _configuration_common, _generation_utils = _import_transformers_tests(_tests_folder)
ModelTesterMixin = _modeling_common.ModelTesterMixin
ids_tensor = _modeling_common.ids_tensor
random_attention_mask = _modeling_common.random_attention_mask
ConfigTester = _configuration_common.ConfigTester
GENERATION_MIXIN_PRESENT = not getattr(_generation_utils, "PLACEHOLDER", False)
GenerationTesterMixin = _generation_utils.GenerationTesterMixin

NB_FEATURES = 16
TASK_LABELS = {
    "sequence-classification": "sequence",
    "token-classification": "token",
    "masked-lm": "token",
    "causal-lm": "token",
}


class PerformerModelTester:
    """Builds tiny Performer configs and inputs, in the style of transformers' ``BertModelTester``.

    Args:
        parent: the ``unittest.TestCase`` running the tests.
        source: "bert", "gpt2", "llama" (the tiny source configs of ``tests/conftest.py``) or "gpt_neox".
        batch_size, seq_length: the inputs' ``[batch_size, seq_length]``.
    """

    SOURCE_BUILDERS = {"bert": tiny_bert_config, "gpt2": tiny_gpt2_config, "llama": tiny_llama_config,
                       "gpt_neox": lambda **overrides: GPTNeoXConfig(**{**TINY_GPT_NEOX, **overrides})}

    def __init__(self, parent, source: str, batch_size: int = 2, seq_length: int = 7, num_labels: int = 3):
        self.parent = parent
        self.source = source
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = True
        self.num_labels = num_labels
        self.num_choices = 2
        source_config = self.source_config()
        self.vocab_size = source_config.vocab_size
        self.hidden_size = source_config.hidden_size
        self.num_hidden_layers = source_config.num_hidden_layers
        self.num_attention_heads = source_config.num_attention_heads
        self.pad_token_id = source_config.pad_token_id

    def source_config(self):
        """The tiny source config (token ids 0 / 1 / 2 for padding / bos / eos, as transformers' testers)."""
        overrides = {"pad_token_id": 0}
        if self.source != "bert":
            overrides.update(bos_token_id=1, eos_token_id=2)
        return self.SOURCE_BUILDERS[self.source](**overrides)

    def get_config(self) -> PerformerConfig:
        return PerformerConfig(source_config=self.source_config(), nb_features=NB_FEATURES, num_labels=self.num_labels)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.source == "bert":
            inputs["token_type_ids"] = ids_tensor([self.batch_size, self.seq_length], 2)
        return self.get_config(), inputs

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()


class _PerformerCommonTests(ModelTesterMixin):
    """transformers' ``ModelTesterMixin`` on the Performer classes of one source architecture, plus
    ``ConfigTester`` on ``PerformerConfig``."""

    source = ""
    # transformers runs its `_init_weights` completeness test only for models it dates after 2023 (from a copyright
    # line); initialisation of every weight and feature-map buffer is part of issue 16, so it runs here.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        # transformers recognises base models (no loss: skipped by the training tests; the one the RoPE-scaling tests
        # build) by class name in MODEL_MAPPING_NAMES, which lists in-tree models only: list PerformerModel there for
        # the duration of each test, as an in-tree model would be.
        # Likewise PerformerForCausalLM in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (the causal-LM loss tests look for it).
        for names, model_class in ((MODEL_MAPPING_NAMES, PerformerModel),
                                   (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, PerformerForCausalLM)):
            names_patch = mock.patch.dict(names, {PERFORMER_MODEL_TYPE: model_class.__name__})
            names_patch.start()
            self.addCleanup(names_patch.stop)
        self.model_tester = PerformerModelTester(self, self.source)
        # The source config as config.json holds it (a dict), so that ConfigTester's JSON round trips compare like
        # with like (transformers' composite testers pass their sub-configs as dicts too). Likewise the favor settings
        # are passed as their dict (`nb_features=` is accepted too but saved inside `favor_settings`).
        serialized = json.loads(self.model_tester.get_config().to_json_string())
        self.config_tester = ConfigTester(
            self,
            config_class=PerformerConfig,
            source_config=serialized["source_config"],
            favor_settings=serialized["favor_settings"],
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_sdpa_can_dispatch_non_composite_models(self):
        # transformers' test expects "sdpa" when no attn_implementation is given; a Performer model's default is
        # "favor" (linear attention, the point of the class). The same checks with that default: favor by default,
        # then attn_implementation="sdpa" / "eager" reach every attention module of the wrapped model.
        for model_class in self.all_model_classes:
            config, _ = self.model_tester.prepare_config_and_inputs_for_common()
            with tempfile.TemporaryDirectory() as folder:
                model_class(config).save_pretrained(folder)
                self.assertEqual(model_class.from_pretrained(folder).config._attn_implementation, "favor")
                for implementation in ("sdpa", "eager"):
                    model = model_class.from_pretrained(folder, attn_implementation=implementation)
                    self.assertEqual(model.config._attn_implementation, implementation)
                    for name, submodule in model.named_modules():
                        module_config = getattr(submodule, "config", None)
                        if type(submodule).__name__.endswith("Attention") and module_config is not None:
                            self.assertEqual(module_config._attn_implementation, implementation, msg=name)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # transformers finds the labels' shape from the class name in its Auto mappings; ours are named by task.
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        labels = TASK_LABELS.get(getattr(model_class, "task", None))
        if return_labels and labels == "sequence":
            inputs_dict["labels"] = torch.zeros(self.model_tester.batch_size, dtype=torch.long)
        elif return_labels and labels == "token":
            inputs_dict["labels"] = torch.zeros(
                (self.model_tester.batch_size, self.model_tester.seq_length), dtype=torch.long
            )
        return inputs_dict


class PerformerBertCommonTest(_PerformerCommonTests, unittest.TestCase):
    source = "bert"
    all_model_classes = (
        PerformerModel,
        PerformerForMaskedLM,
        PerformerForSequenceClassification,
        PerformerForTokenClassification,
    )


if GENERATION_MIXIN_PRESENT:

    class _PerformerCausalCommonTests(_PerformerCommonTests, GenerationTesterMixin):
        """Adds transformers' ``GenerationTesterMixin`` (generative classes: ``PerformerForCausalLM``)."""

        def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
            # What transformers asks of a model whose cache is not keys / values ("Please overwrite
            # `_check_past_key_values_for_generate`", as its recurrent models do): favor layers hold a
            # FavorCacheLayer, a token count and the recurrent state kv [B, H, m, d], k_sum [B, H, m],
            # stabilizer [B, H] (H query heads, m features), whatever the length; softmax layers keep keys / values.
            source = config.get_text_config(decoder=True)  # the source config (what the mixin passes)
            self.assertEqual(source.num_hidden_layers, len(past_key_values))
            heads = source.num_attention_heads
            head_dim = getattr(source, "head_dim", None) or source.hidden_size // heads
            key_shape, value_shape = self._get_attention_shape(batch_size, seq_length, source)
            for layer in past_key_values.layers:
                if is_favor_cache_layer(layer):
                    self.assertEqual(layer.get_seq_length(), seq_length)
                    kv, k_sum, stabilizer = layer.state
                    self.assertEqual(kv.shape, (batch_size, heads, NB_FEATURES, head_dim))
                    self.assertEqual(k_sum.shape, kv.shape[:-1])
                    self.assertEqual(stabilizer.shape, kv.shape[:2])
                else:
                    self.assertEqual(layer.keys.shape, key_shape)
                    self.assertEqual(layer.values.shape, value_shape)

else:

    class _PerformerCausalCommonTests(_PerformerCommonTests):
        """Without the generation mixin file (placeholder): transformers' own rule
        (``test_generation_tester_mixin_inheritance``) is that a tester running no generate tests declares no
        generative classes."""

        all_generative_model_classes = ()


class PerformerGPT2CommonTest(_PerformerCausalCommonTests, unittest.TestCase):
    source = "gpt2"
    all_model_classes = (
        PerformerModel,
        PerformerForCausalLM,
        PerformerForSequenceClassification,
        PerformerForTokenClassification,
    )


class PerformerLlamaCommonTest(_PerformerCausalCommonTests, unittest.TestCase):
    source = "llama"
    all_model_classes = (
        PerformerModel,
        PerformerForCausalLM,
        PerformerForSequenceClassification,
        PerformerForTokenClassification,
    )


class PerformerGPTNeoXCommonTest(_PerformerCausalCommonTests, unittest.TestCase):
    """Partial rotary embeddings (transformers' RoPE-scaling and partial-rotation tests run on it), fused QKV,
    parallel residual, the cache as ``layer_past``."""

    source = "gpt_neox"
    all_model_classes = (
        PerformerModel,
        PerformerForCausalLM,
        PerformerForSequenceClassification,
        PerformerForTokenClassification,
    )


def test_generation_mixin_present():
    if not GENERATION_MIXIN_PRESENT:
        pytest.skip(
            "tests/generation/test_utils.py (GenerationTesterMixin) is not in transformers' sdist: put the file of "
            "the installed version's tag there to run the generation tests"
        )
