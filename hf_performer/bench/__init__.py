"""Measuring on the user's machine: ``hf-performer bench attention | memory | approximation | decode``.

* :mod:`.machine`: the machine record (CPU, threads, versions), the load warning, the clock, process memory;
* :mod:`.attention`: one attention layer's speed and memory, FAVOR+'s approximation error, a whole model's forward
  speed (``hf-performer quickstart``);
* :mod:`.decode`: per-token decode latency and cache memory, FAVOR+'s recurrent state against softmax's KV cache;
* :mod:`.report`: summaries (crossover length, decode targets), tables, plots, the JSON + PNG outputs.

The ``bench`` verb's parser and runners are :mod:`hf_performer.cli.bench`.
"""
