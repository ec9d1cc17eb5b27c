"""The fidelity report does not compare a task head that transformers initialised randomly at load."""

from transformers import BertForSequenceClassification, BertModel

from hf_performer.conversion import convert_to_performer, fidelity_report, load_source

ONE_LAYER = dict(num_hidden_layers=1, vocab_size=50)  # overrides of the shared tiny BERT (conftest)


def _report(source):
    return fidelity_report(source, convert_to_performer(source, nb_features=16), max_length=16)


def test_a_head_missing_from_the_checkpoint_is_not_compared(tmp_path, tiny_bert_config):
    BertModel(tiny_bert_config(**ONE_LAYER)).save_pretrained(tmp_path / "base")
    source, _ = load_source(tmp_path / "base", "sequence-classification")  # the classifier is new
    report = _report(source)
    assert report.untrained_head
    assert report.prediction_agreement is None and report.logits_kl is None and report.logits_relative_error is None
    table = report.format_table()
    assert "agreement" not in table and "head: newly initialised" in table


def test_a_trained_head_is_compared(tmp_path, tiny_bert_config):
    BertForSequenceClassification(tiny_bert_config(**ONE_LAYER)).save_pretrained(tmp_path / "classifier")
    source, _ = load_source(tmp_path / "classifier")
    report = _report(source)
    assert not report.untrained_head and report.prediction_agreement is not None
    assert "prediction agreement" in report.format_table()
    # A model built in memory (not loaded) counts as trained: nothing says otherwise.
    assert _report(BertForSequenceClassification(tiny_bert_config(**ONE_LAYER))).prediction_agreement is not None
