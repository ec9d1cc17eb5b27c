"""Fixtures shared by the test files."""

import os
import sys
from pathlib import Path

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
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_tiny_llama(folder, tokenizer, max_positions: int):
    """A seeded tiny Llama causal LM with ``tokenizer``'s vocabulary and ``max_positions`` positions, saved with the
    tokenizer in ``folder`` (what ``hf-performer evaluate`` loads); returns ``folder``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=max_positions)
                     ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


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


# --------------------------------------------------------------------------------------------
# Tiny tokenizers: real tokenizer classes over small vocabularies (nothing downloaded), and the GPT-2 tokenizer of
# ../shared/data for the retrieval tasks' prompts.
# --------------------------------------------------------------------------------------------

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def word_piece_tokenizer(folder, words, save_to=None):
    """A ``BertTokenizer`` over :data:`BERT_SPECIAL_TOKENS` followed by ``words`` (duplicates of the special tokens
    are dropped), its ``vocab.txt`` written into ``folder``; saved into ``save_to`` too when given."""
    from transformers import BertTokenizer

    tokens = [*BERT_SPECIAL_TOKENS, *(word for word in words if word not in BERT_SPECIAL_TOKENS)]
    vocab_file = Path(folder) / "vocab.txt"
    vocab_file.parent.mkdir(parents=True, exist_ok=True)
    vocab_file.write_text("\n".join(tokens) + "\n")
    tokenizer = BertTokenizer(str(vocab_file))
    if save_to is not None:
        tokenizer.save_pretrained(save_to)
    return tokenizer


def word_level_tokenizer(words):
    """A fast word-level tokenizer over ``<unk>``, ``<eos>`` and ``words`` split on whitespace (``<eos>`` pads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(dict.fromkeys(["<unk>", "<eos>", *words]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    """The GPT-2 tokenizer of ``../shared/data`` (the test is skipped where that folder is absent)."""
    if not (SHARED_DATA / "gpt2-tokenizer").is_dir():
        pytest.skip("../shared/data is absent (the GPT-2 tokenizer)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHARED_DATA / "gpt2-tokenizer")


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
