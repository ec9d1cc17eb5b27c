"""Model card templates (installed as ``hf_performer.model_cards`` package data); see README.md here."""
