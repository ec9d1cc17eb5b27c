"""Fixtures shared by the test files."""

import os
import sys

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (the parallel path's selection kernel,
# tests/test_parallel_path.py); it must be on before anything imports triton.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

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


# --------------------------------------------------------------------------------------------
# Tiny source models: the shared BERT / GPT-2 / Llama configurations (2 layers, width 32, vocabulary 99).
# A test passes overrides for what it needs (its tokenizer's vocabulary size, token ids, ...); a test that needs
# a different shape of model (4 heads, inverse-layer scaling, ...) keeps its own configuration.
# Module-level tables of test cases (parametrize) import the builders: `from conftest import tiny_bert_config`.
# --------------------------------------------------------------------------------------------

TINY_VOCAB = 99
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                 vocab_size=TINY_VOCAB)
TINY_GPT2 = dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=TINY_VOCAB)
TINY_LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=37, vocab_size=TINY_VOCAB)


def tiny_bert_config(**overrides):
    """A tiny ``BertConfig`` (:data:`TINY_BERT` updated by ``overrides``)."""
    from transformers import BertConfig

    return BertConfig(**{**TINY_BERT, **overrides})


def tiny_gpt2_config(**overrides):
    """A tiny ``GPT2Config`` (:data:`TINY_GPT2` updated by ``overrides``)."""
    from transformers import GPT2Config

    return GPT2Config(**{**TINY_GPT2, **overrides})


def tiny_llama_config(**overrides):
    """A tiny ``LlamaConfig`` with grouped-query attention (4 heads, 2 key/value heads; :data:`TINY_LLAMA` updated
    by ``overrides``)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def benchmark_script(name: str):
    """The module of ``benchmarks/scripts/NAME.py`` (not a package: loaded from its file), for collector tests."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_tiny_hybrid_and_softmax(folder, tokenizer) -> None:
    """``folder/hybrid`` (a tiny Llama converted to window 4 + 1 sink with a hedgehog tail) and ``folder/softmax``
    (its source), each with ``tokenizer``: the two models a collector of window-hybrid results compares."""
    import torch
    from transformers import LlamaForCausalLM

    from hf_performer import convert_to_performer

    torch.manual_seed(0)
    source = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=256))
    for name, model in (("hybrid", convert_to_performer(source, feature_map="hedgehog", window=4, sinks=1)),
                        ("softmax", source)):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


def forbid_new_evaluations(monkeypatch) -> None:
    """Make any perplexity or passkey evaluation fail: a resumed collector must read its kept records."""
    from hf_performer.tasks import evaluation, passkey

    def evaluated_again(*args, **kwargs):
        raise AssertionError("a kept evaluation was run again")

    monkeypatch.setattr(evaluation, "evaluate_perplexity_model", evaluated_again)
    monkeypatch.setattr(passkey, "evaluate_passkey_model", evaluated_again)


def cached(model, cache) -> dict:
    """``cache`` as the keyword argument ``model``'s forward (and generate) takes it: ``cache=`` from transformers
    5.24 on, ``past_key_values=`` before (the old name warns, then goes in 5.40): ``model(ids, **cached(model, c))``."""
    from hf_performer.cache import cache_argument_name

    return {cache_argument_name(model.forward): cache}


@pytest.fixture(name="tiny_bert_config", scope="session")
def tiny_bert_config_builder():
    """:func:`tiny_bert_config`: call it with overrides, e.g. ``tiny_bert_config(vocab_size=len(vocab))``."""
    return tiny_bert_config


@pytest.fixture(name="tiny_gpt2_config", scope="session")
def tiny_gpt2_config_builder():
    """:func:`tiny_gpt2_config`: call it with overrides, e.g. ``tiny_gpt2_config(vocab_size=len(tokenizer))``."""
    return tiny_gpt2_config


@pytest.fixture(name="tiny_llama_config", scope="session")
def tiny_llama_config_builder():
    """:func:`tiny_llama_config`: call it with overrides, e.g. ``tiny_llama_config(pad_token_id=0)``."""
    return tiny_llama_config


@pytest.fixture(scope="module")
def tiny_llama_lm():
    """A tiny random ``LlamaForCausalLM`` (GQA, 256 positions, seed 0) in eval mode, shared by a module's tests."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(max_position_embeddings=256)).eval()


def logits_of(model, ids):
    """``model(input_ids=ids).logits`` without gradients."""
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test starts Accelerate's process-wide ``AcceleratorState`` anew (as accelerate's own ``AccelerateTestCase``
    does): the recipes run in-process here, and a state left by an earlier test with another ``mixed_precision``
    would refuse the next ``Accelerator(mixed_precision=...)``. The distributed ``PartialState`` is kept."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=False)
