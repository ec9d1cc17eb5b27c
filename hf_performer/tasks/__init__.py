"""Tasks: the GLUE / IMDB classification tasks and the causal-LM texts (:mod:`.data`: specs, loading, tokenisation)
and their evaluation (:mod:`.evaluation`: task metrics, sliding-window perplexity (also by window position), the
``evaluate`` verb; :mod:`.passkey`: the passkey-retrieval probe).

Nothing is imported here, so that ``hf-performer --help`` stays fast: import ``hf_performer.tasks.data`` or
``hf_performer.tasks.evaluation``.
"""
