"""The settings of ``hf-performer linearize`` (:class:`LinearizeSettings`: the schema, checked in one place) and the
convert stage's arguments they give (:func:`conversion_arguments`); the stages themselves are :mod:`.linearize`."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from .arguments import RecipeError

FEATURE_MAP_OPTIONS = {"tie_qk": False}
"""Learned maps have separate query and key maps (Hedgehog / LoLCATs); they start at ``feature_map_init``: the
identity by default (a square projection: ``nb_features`` 2 x head_dim for hedgehog), or FAVOR+'s orthogonal
random projection (``favor+``, any size)."""
MIXED_PRECISIONS = ("no", "bf16")
"""Training precisions: ``bf16`` runs both training stages under bfloat16 autocast (projections and MLPs in bf16; the
attention operators and feature maps keep their float32 islands); weights, optimizer states and the evaluation stay
float32."""
_IN_TIME_ONLY = ("progress", "time_limit", "eval_batch_size")
"""Settings a resumed run may change (they do not change what is trained)."""


@dataclass
class LinearizeSettings:
    """Everything a linearize run depends on (recorded in :data:`LINEARIZE_FILE`, compared on resume)."""

    source: str
    train_files: list[str]
    max_train_chars: int | None = None
    feature_map: str = "hedgehog"
    nb_features: int | None = None
    feature_map_init: str = "identity"
    window: int = 64
    sinks: int = 4
    sparse_cache: int = 0
    sparse_cache_selection: str = "recall"
    sparse_cache_span: int = 1
    tail_cap: int | None = None
    tail_gate: bool = False
    linear_tail: bool = True
    softmax_layers: list[int] = field(default_factory=list)
    softmax_worst: int = 0
    cache_budget: str | None = None
    budget_context: int = 16384
    transfer_steps: int = 200
    transfer_length: int = 1024
    transfer_batch_size: int = 8
    transfer_learning_rate: float = 1e-2
    transfer_schedule: str = "constant"
    lora_steps: int = 200
    block_size: int = 1024
    batch_size: int = 1
    gradient_accumulation_steps: int = 8
    learning_rate: float = 1e-4
    lora_r: int = 8
    lora_alpha: int = 16
    lora_target_modules: list[str] | None = None
    teacher_weight: float | None = None
    teacher_model: str | None = None
    window_dropout: float = 0.0
    eval_file: str | None = None
    eval_context: int = 1024
    max_eval_chars: int | None = 200_000
    eval_batch_size: int = 2
    baseline: str | None = None
    seed: int = 0
    mixed_precision: str = "no"
    time_limit: float | None = None
    progress: bool = True
    checkpoint_every: int | None = None

    def check(self) -> None:
        """Raise :class:`RecipeError` (one line: what is wrong, what is accepted) on bad values or missing files."""
        if self.baseline not in (None, "softmax"):
            raise RecipeError(f"--baseline {self.baseline!r} is not known; accepted: softmax")
        from ..feature_maps import LEARNED_MAP_INITS

        if self.feature_map_init not in LEARNED_MAP_INITS:
            raise RecipeError(f"--feature-map-init {self.feature_map_init!r} is not known; accepted: "
                              f"{', '.join(LEARNED_MAP_INITS)}")
        if self.window_dropout and not (0.0 < self.window_dropout <= 1.0 and self.linear_tail and not self.baseline):
            raise RecipeError(f"--window-dropout {self.window_dropout}: accepted a probability in (0, 1] for a hybrid "
                              "with a tail (not --no-tail, not --baseline)")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise RecipeError(f"--mixed-precision {self.mixed_precision!r} is not known; accepted: "
                              f"{', '.join(MIXED_PRECISIONS)}")
        for name in ("window", "sinks", "sparse_cache", "transfer_steps", "lora_steps", "softmax_worst"):
            if getattr(self, name) < 0:
                raise RecipeError(f"--{name.replace('_', '-')} must be an int >= 0, got {getattr(self, name)}")
        if self.sparse_cache_span < 1 or self.sparse_cache_span % 2 == 0:
            raise RecipeError(f"--sparse-cache-span must be an odd int >= 1 (1 = each token on its own), got "
                              f"{self.sparse_cache_span}")
        for name in ("transfer_length", "transfer_batch_size", "block_size", "batch_size", "eval_context",
                     "eval_batch_size", "gradient_accumulation_steps", "lora_r", "lora_alpha"):
            if getattr(self, name) < 1:
                raise RecipeError(f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)}")
        if self.teacher_weight is not None and not self.teacher_weight > 0:
            raise RecipeError(f"--teacher-weight must be > 0 (the teacher term's weight), got {self.teacher_weight}")
        if self.teacher_model is not None:
            if self.teacher_weight is None:
                raise RecipeError("--teacher-model set without --teacher-weight: give the teacher term's weight "
                                  "(e.g. --teacher-weight 1)")
            from transformers import AutoConfig

            from ..conversion.gguf import from_pretrained_arguments
            from .distillation import teacher_config

            path, gguf = from_pretrained_arguments(self.source)
            teacher_config(self.teacher_model, AutoConfig.from_pretrained(path, **gguf))
        if self.eval_context < 2 or self.block_size < 2 or self.transfer_length < 2:
            raise RecipeError("--eval-context, --block-size and --transfer-length must be >= 2 tokens")
        from ..conversion.attention_transfer import SCHEDULES

        if self.transfer_schedule not in SCHEDULES:
            raise RecipeError(f"--transfer-schedule {self.transfer_schedule!r} is not known; accepted: "
                              f"{', '.join(SCHEDULES)}")
        if any(not isinstance(layer, int) or layer < 0 for layer in self.softmax_layers):
            raise RecipeError(f"--softmax-layers takes layer indices >= 0, got {self.softmax_layers}")
        if self.cache_budget is not None:
            if self.softmax_worst:
                raise RecipeError("--cache-budget and --softmax-worst both choose the softmax layers; give one")
            if not self.linear_tail or self.baseline:
                raise RecipeError("--cache-budget allocates the sparse caches of window layers with a tail; it takes "
                                  "no --no-tail or --baseline")
            if self.budget_context < 1:
                raise RecipeError(f"--budget-context must be an int >= 1, got {self.budget_context}")
            from ..conversion.cache_budget import parse_cache_budget

            parse_cache_budget(self.cache_budget, 1)  # the form; the bytes depend on the model
        if self.window == 0 and self.sinks == 0 and not self.linear_tail:
            raise RecipeError("--no-tail with --window 0 and --sinks 0 leaves no key to attend to; give a window")
        if self.tail_gate and not self.linear_tail:
            raise RecipeError("--tail-gate weighs the linear tail: it cannot go with --no-tail")
        if self.tail_cap is not None and (self.tail_cap < 0 or not self.linear_tail):
            raise RecipeError(f"--tail-cap bounds the linear tail: an int >= 0 (0 = unbounded) without --no-tail, "
                              f"got {self.tail_cap}{' with --no-tail' if not self.linear_tail else ''}")
        from ..favor_settings import feature_map_kind
        from ..feature_maps import available_feature_maps

        if self.feature_map not in available_feature_maps():
            raise RecipeError(f"--feature-map {self.feature_map!r} is not known; accepted: {available_feature_maps()}")
        if not self.baseline and self.linear_tail and self.transfer_steps and \
                feature_map_kind(self.feature_map) != "learned":
            learned = [name for name in available_feature_maps() if feature_map_kind(name) == "learned"]
            raise RecipeError(f"--feature-map {self.feature_map} has nothing to learn in the transfer stage; use a "
                              f"learned map ({', '.join(learned)}) or --transfer-steps 0")
        if self.time_limit is not None and self.time_limit <= 0:
            raise RecipeError(f"--time-limit must be > 0 minutes, got {self.time_limit}")
        if not self.train_files:
            raise RecipeError("at least one --train-file is needed")
        for path in [*self.train_files, *([self.eval_file] if self.eval_file else [])]:
            if not os.path.isfile(path):
                raise RecipeError(f"no such file: {path} (--train-file / --eval-file take text files: raw text, or "
                                  "JSON lines with a 'text' field, .gz accepted)")

    @property
    def checkpoint_interval(self) -> int:
        """LoRA optimizer steps between checkpoints (``checkpoint_every``, default a quarter of ``lora_steps``)."""
        return self.checkpoint_every or max(1, self.lora_steps // 4)

    def identity(self) -> dict:
        """The settings that decide what is trained (a resumed run must have the same), with the contents'
        fingerprints of the training and evaluation files (a file changed under the same name is another run)."""
        from ..tasks.data import file_fingerprint

        identity = {key: value for key, value in asdict(self).items() if key not in _IN_TIME_ONLY}
        if self.cache_budget is None:  # runs staged before the cache budget existed continue
            del identity["cache_budget"], identity["budget_context"]
        if not self.window_dropout:  # nor before the window dropout
            del identity["window_dropout"]
        if not self.tail_gate:  # nor before the tail gate
            del identity["tail_gate"]
        if self.sparse_cache_selection == "recall":  # nor before the selection rule
            del identity["sparse_cache_selection"]
        if self.sparse_cache_span == 1:  # nor before the span
            del identity["sparse_cache_span"]
        identity["train_data_fingerprint"] = file_fingerprint(self.train_files)
        identity["eval_data_fingerprint"] = file_fingerprint(self.eval_file) if self.eval_file else None
        return identity



def conversion_arguments(settings: LinearizeSettings) -> dict:
    """The keyword arguments of ``convert_to_performer`` for the convert stage."""
    return dict(feature_map=settings.feature_map, nb_features=settings.nb_features, seed=settings.seed,
                feature_map_options={**FEATURE_MAP_OPTIONS, "init": settings.feature_map_init},
                window=settings.window, sinks=settings.sinks, sparse_cache=settings.sparse_cache,
                sparse_cache_selection=settings.sparse_cache_selection,
                sparse_cache_span=settings.sparse_cache_span, tail_cap=resolved_tail_cap(settings),
                tail_gate=settings.tail_gate or None,
                linear_tail=settings.linear_tail, softmax_weight="auto",
                keep_softmax_layers=settings.softmax_layers)


def resolved_tail_cap(settings: LinearizeSettings) -> int:
    """The model's ``tail_cap``: the given one, else the most tokens a tail holds at the longest training length
    (transfer and LoRA), so that a longer context never weighs the tail more than training did; 0 without a tail."""
    if not settings.linear_tail:
        return 0
    if settings.tail_cap is not None:
        return settings.tail_cap
    from ..favor_schema import DEFAULT_CHUNK_SIZE
    from ..window_tail_cap import training_tail_tokens

    length = max(settings.transfer_length, settings.block_size)
    return max(1, training_tail_tokens(length, settings.window, settings.sinks, settings.sparse_cache,
                                       DEFAULT_CHUNK_SIZE))
