"""The choices and defaults of the benchmarks, declared without torch: the ``hf-performer bench`` parsers read them
(``--help`` imports no torch); :mod:`.attention`, :mod:`.decode` and :mod:`.report` import them from here."""

ATTENTION_IMPLEMENTATIONS = ("favor", "window", "window-cache", "clustered", "improved-clustered", "lsh", "sdpa",
                             "eager")
BIDIRECTIONAL_ONLY = ("clustered", "improved-clustered", "lsh")
CAUSAL_ONLY = ("window-cache",)
DEFAULT_ATTENTION_IMPLEMENTATIONS = ("favor", "sdpa", "eager")  # the others on request
ATTENTION_MODES = ("bidirectional", "causal")


def runs_in_mode(implementation: str, mode: str) -> bool:
    """Whether ``implementation`` runs in ``mode`` (:data:`BIDIRECTIONAL_ONLY` / :data:`CAUSAL_ONLY` do not both)."""
    return not (implementation in BIDIRECTIONAL_ONLY and mode == "causal") and \
        not (implementation in CAUSAL_ONLY and mode != "causal")

DECODE_IMPLEMENTATIONS = ("favor", "softmax")

DEFAULT_CLUSTERS = 100
DEFAULT_TOPK = 32
DEFAULT_BUCKET_SIZE = 64
DEFAULT_WINDOW = 64
DEFAULT_SINKS = 4
DEFAULT_SPARSE_CACHE = 256  # window-cache: hard keys per key head (the causal-LM configuration of issue 33)

FULL_CONTEXT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_CONTEXT_LENGTHS = (512, 1024, 2048)
