"""Fine-tuning recipes (Accelerate), installed as ``hf_performer.recipes`` from the top-level ``recipes/`` folder.

- :mod:`.arguments`: the recipes' flags (the only argparse of the package outside the CLI), the command line of a
  recorded run, the ``hf-performer results`` verb;
- :mod:`.model`: the model to train (Performer folder, on-the-fly conversion, softmax baseline), LoRA, redraws;
- :mod:`.train`: the training loop, ``train(args, loss_hooks=...)`` and the scripts' ``main(kind, argv)``;
- :mod:`.results`: ``metrics.json`` / ``eval_curve.json`` of a run, and the recovery results collected from runs;
- :mod:`.report`: the recovery plot and table.

The scripts ``text_classification.py`` and ``causal_lm.py`` run with ``python recipes/...`` or
``accelerate launch recipes/...``; see ``recipes/README.md``.
"""
