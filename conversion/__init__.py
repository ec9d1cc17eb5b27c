"""Conversion of pretrained softmax models to FAVOR+ (installed as ``hf_performer.conversion``)."""
