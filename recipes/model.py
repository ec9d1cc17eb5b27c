"""The model a recipe trains: a Performer folder as it is, a softmax model converted on the fly, or a softmax
baseline; the redraw interval of its random feature maps; PEFT LoRA adapters on its attention projections.
Heavy imports (transformers, peft, the converter) happen inside the functions.
"""

from __future__ import annotations

from .arguments import LORA_TARGET_MODULES, RecipeError



def _is_performer_folder(name_or_path: str) -> bool:
    from transformers import AutoConfig

    from .. import modeling_performer  # noqa: F401 - registers model_type "performer"

    try:
        return AutoConfig.from_pretrained(name_or_path).model_type == "performer"
    except (OSError, ValueError) as error:
        raise RecipeError(f"cannot load a model configuration from --model {name_or_path!r}: {error}") from None


def set_redraw_interval(model, interval: int) -> int:
    """Set the redraw interval of every random feature map of ``model`` and of its ``favor_settings``.

    Returns:
        How many feature maps were updated.
    """
    from ..feature_maps import RandomFeatureMap

    if interval < 0:
        raise RecipeError(f"--redraw-interval must be >= 0, got {interval}")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None) == "performer":
        config.redraw_interval = interval
    updated = 0
    for module in model.modules():
        if isinstance(module, RandomFeatureMap):
            module.redraw_interval = interval
            updated += 1
    return updated


def load_model(args, num_labels: int | None = None, id2label: dict | None = None,
               problem_type: str | None = None):
    """The model to train and a description of how it was obtained.

    Args:
        args: the recipe arguments (``--model``, ``--attention``, ``--convert``, FAVOR+ options).
        num_labels, id2label, problem_type: classification head (``None`` for causal LM).

    Returns:
        ``(model, info)`` with ``info = {"source", "attention", "converted", "favor_settings"}``.

    Raises:
        RecipeError: inconsistent options (``--attention softmax`` on a Performer folder, ``--no-convert`` on a
            softmax model with ``--attention favor``, ``--convert`` on a Performer folder).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..conversion import ConversionError, convert_to_performer, load_source

    task = "causal-lm" if args.kind == "causal-lm" else "sequence-classification"
    head_kwargs = {}
    if num_labels is not None:
        head_kwargs = dict(num_labels=num_labels, id2label=id2label,
                           label2id={v: k for k, v in (id2label or {}).items()}, problem_type=problem_type)
    performer_folder = _is_performer_folder(args.model)
    if performer_folder:
        if args.attention == "softmax":
            raise RecipeError(f"{args.model} is a Performer (FAVOR+) folder; --attention softmax needs a softmax model")
        if args.convert:
            raise RecipeError(f"{args.model} is already a Performer folder: --convert does not apply")
        auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
        model = auto.from_pretrained(args.model, **head_kwargs)
        converted = False
    else:
        convert = args.convert if args.convert is not None else args.attention == "favor"
        if args.attention == "favor" and not convert:
            raise RecipeError(f"{args.model} is a softmax model: --attention favor needs --convert (the default)")
        if args.attention == "softmax" and convert:
            raise RecipeError("--attention softmax trains the softmax model: --convert does not apply")
        try:
            source, _ = load_source(args.model, task, **head_kwargs)
            if convert:
                model = convert_to_performer(
                    source, task=task, feature_map=args.feature_map, nb_features=args.nb_features,
                    keep_softmax_layers=args.keep_softmax_layers,
                    max_position_embeddings=args.max_position_embeddings, seed=args.favor_seed,
                    redraw_interval=args.redraw_interval,
                )
            else:
                model = source
        except ConversionError as error:
            raise RecipeError(str(error)) from None
        converted = convert
    is_performer = getattr(model.config, "model_type", None) == "performer"
    if args.redraw_interval is not None:
        if not is_performer:
            raise RecipeError("--redraw-interval applies to FAVOR+ models, not to --attention softmax")
        set_redraw_interval(model, args.redraw_interval)
    if num_labels is not None and problem_type is not None:
        model.config.problem_type = problem_type
    info = {
        "source": args.model,
        "attention": "favor" if is_performer else "softmax",
        "converted": converted,
        "favor_settings": dict(model.config.resolved_favor_settings) if is_performer else None,
    }
    return model.train(), info


def apply_lora(model, args):
    """Wrap ``model`` with PEFT LoRA adapters on its attention projections (see :data:`LORA_TARGET_MODULES`).

    Only the adapters (and, for classification, the newly initialised head) are trainable.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    config = model.config
    model_type = config.source_config.model_type if config.model_type == "performer" else config.model_type
    targets = args.lora_target_modules or LORA_TARGET_MODULES.get(model_type)
    if not targets:
        raise RecipeError(
            f"no default LoRA target modules for model type {model_type!r} (known: {sorted(LORA_TARGET_MODULES)}); "
            "pass --lora-target-modules"
        )
    task_type = TaskType.CAUSAL_LM if args.kind == "causal-lm" else TaskType.SEQ_CLS
    lora_config = LoraConfig(task_type=task_type, r=args.lora_r, lora_alpha=args.lora_alpha,
                             lora_dropout=args.lora_dropout, target_modules=targets,
                             fan_in_fan_out=model_type == "gpt2")
    model = get_peft_model(model, lora_config)
    # peft trains the adapters and, for classification, its copy of the new head (modules_to_save) only
    others = [name for name, p in model.named_parameters()
              if p.requires_grad and "lora_" not in name and "modules_to_save" not in name]
    if others:  # feature maps and softmax weights (trained by attention transfer) must stay as they are
        raise RecipeError(f"LoRA left parameters other than the adapters trainable: {others[:4]}")
    return model
