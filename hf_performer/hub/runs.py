"""The run records a model folder holds, as its card reports them: ``attention_transfer.json`` (``hf-performer
distill``: data, steps, per-layer errors before and after, :func:`transfer_context`), ``linearize.json``
(``hf-performer linearize``: the stages, the training record and the perplexity, :func:`linearize_context`) and a
fine-tuning recipe's ``metrics.json`` (its results are read by :func:`~.results.recipe_results`).

Only base names of files reach the card (no local path), and numbers are quoted as recorded.
"""

from __future__ import annotations

import os

from .describe import TRANSFER_LOSSES
from .folder import ModelCardError
from .results import _is_number

LINEARIZE_STAGE_WORDS = {
    "convert": "conversion (window settings, learned tail maps)",
    "transfer": "attention transfer of the tail (maps and gamma only)",
    "select": "layers the tail fits worst back on softmax",
    "lora": "LoRA on the attention projections, merged",
    "evaluate": "perplexity",
}


def _stage_row(name: str, stage: dict) -> dict:
    details = stage.get("details") or {}
    done = stage.get("status") == "done"
    what = []
    if name in ("transfer", "lora") and done:
        steps = details.get("steps_done")
        requested = details.get("steps_requested")
        if steps is not None:
            what.append(f"{steps} steps" + (f" of {requested}" if requested not in (None, steps) else ""))
        if stage.get("tokens_seen"):
            what.append(f"{stage['tokens_seen']:,} tokens")
    if name == "transfer" and done:
        curve = details.get("curve") or []
        if curve and _is_number(curve[0].get("loss")) and _is_number(curve[-1].get("loss")):
            what.append(f"loss {curve[0]['loss']:.4g} -> {curve[-1]['loss']:.4g}")
    if name == "lora" and done and _is_number(details.get("train_loss_first")) and _is_number(
            details.get("train_loss_last")):
        what.append(f"training loss {details['train_loss_first']:.4g} -> {details['train_loss_last']:.4g}")
    if name == "select" and done and details.get("worst_layers") is not None:
        what.append(f"layers {', '.join(map(str, details['worst_layers'])) or 'none'} back on softmax")
    if name == "evaluate" and done and _is_number(details.get("perplexity")):
        what.append(f"perplexity {details['perplexity']:.4g}")
    if stage.get("reason"):
        what.append(str(stage["reason"]))
    return {"name": name, "meaning": LINEARIZE_STAGE_WORDS.get(name, ""), "status": stage.get("status", "?"),
            "what": "; ".join(what), "wall_time": _format_duration(stage["wall_time_s"]) if done and _is_number(stage.get("wall_time_s")) else ""}


def linearize_context(record: dict, where: str) -> dict:
    """What the card's "Linearize run" section shows, from a ``linearize.json`` record.

    Raises:
        ModelCardError: the record is not an object with ``stages`` and ``settings`` objects.
    """
    if not isinstance(record, dict) or not isinstance(record.get("stages"), dict) or \
            not isinstance(record.get("settings"), dict):
        raise ModelCardError(f"{where}: not a linearize.json record (expected an object with 'settings' and 'stages')")
    settings, stages = record["settings"], record["stages"]
    perplexity = record.get("perplexity")
    protocol = record.get("perplexity_protocol") or {}
    eval_file = settings.get("eval_file")
    protocol_text = None
    if _is_number(perplexity):
        parts = [f"windows of {protocol['context_length']} tokens every {protocol['stride']}"
                 if protocol.get("context_length") else None,
                 f"{protocol['num_tokens']:,} tokens scored" if protocol.get("num_tokens") else None,
                 f"first {settings['max_eval_chars']:,} characters" if settings.get("max_eval_chars") else None]
        protocol_text = ", ".join(part for part in parts if part)
    status = lambda name: (stages.get(name) or {}).get("status")  # noqa: E731
    return {
        "kind": record.get("kind"),
        "stages": [_stage_row(name, stage) for name, stage in stages.items() if isinstance(stage, dict)],
        "train_files": [os.path.basename(str(name)) for name in settings.get("train_files") or []],
        "eval_file": os.path.basename(str(eval_file)) if eval_file else None,
        "perplexity": f"{perplexity:.4f}" if _is_number(perplexity) else None,
        "perplexity_protocol": protocol_text,
        "tokens_seen": record.get("tokens_seen"),
        "wall_time": _format_duration(record["wall_time_s"]) if _is_number(record.get("wall_time_s")) else None,
        "transfer_done": status("transfer") == "done",
        "lora_done": status("lora") == "done",
        "window": settings.get("window"),
        "sinks": settings.get("sinks"),
    }


# --------------------------------------------------------------------------------------------
# Attention transfer (attention_transfer.json of `hf-performer distill`)
# --------------------------------------------------------------------------------------------


def cache_budget_context(record: dict, where: str) -> dict:
    """What the card's "Memory budget" section shows, from a ``cache_budget.json`` record (``hf-performer budget``):
    the budget, what was spent, the choice per layer grouped by option, the measured errors.

    Raises:
        ModelCardError: not such a record.
    """
    required = ("budget_bytes", "context", "total_bytes", "total_error", "layers")
    if not isinstance(record, dict) or any(key not in record for key in required):
        raise ModelCardError(f"{where}: not a cache_budget.json record (expected {', '.join(required)})")
    by_option: dict[str, list[int]] = {}
    for layer, entry in sorted(record["layers"].items(), key=lambda item: int(item[0])):
        by_option.setdefault(str(entry["option"]), []).append(int(layer))
    mib = lambda size: f"{size / 2 ** 20:.1f} MiB"  # noqa: E731
    uniform = record.get("uniform") or {}
    return {
        "budget": mib(record["budget_bytes"]), "spent": mib(record["total_bytes"]), "context": record["context"],
        "softmax": mib(record["softmax_bytes"]) if record.get("softmax_bytes") else None,
        "choices": [{"option": option, "layers": ", ".join(map(str, layers))}
                    for option, layers in sorted(by_option.items(), key=lambda item: (item[0] == "softmax",
                                                                                      int(item[0]) if item[0].isdigit()
                                                                                      else 0))],
        "error": f"{record['total_error']:.4g}",
        "uniform": {"size": uniform["sparse_cache"], "error": f"{uniform['error']:.4g}"} if uniform else None,
        "command": record.get("command"),
        "by_loss": record.get("metric") == "loss",
        "measured": {name: f"{entry['perplexity']:.3f}" for name, entry in (record.get("measured") or {}).items()},
    }


def serving_settings_context(record: dict, where: str) -> dict:
    """What the card's "Serving settings" section shows, from a ``serving_settings.json`` record (``hf-performer
    settings``): what changed since training and the decoding state per sequence against softmax's.

    Raises:
        ModelCardError: not such a record.
    """
    required = ("before", "after", "decoding_state_per_sequence")
    if not isinstance(record, dict) or any(not isinstance(record.get(key), dict) for key in required):
        raise ModelCardError(f"{where}: not a serving_settings.json record (expected {', '.join(required)})")
    mib = lambda size: f"{size / 2 ** 20:.1f} MiB"  # noqa: E731
    return {
        "changed": ", ".join(f"{name} {record['before'].get(name)} -> {value}"
                             for name, value in record["after"].items() if record["before"].get(name) != value)
        or "nothing",
        "rows": [{"context": f"{int(context):,}", "state": mib(entry["state_bytes"]),
                  "softmax": mib(entry["softmax_bytes"]),
                  "fraction": f"{entry['state_bytes'] / entry['softmax_bytes']:.1%}"}
                 for context, entry in record["decoding_state_per_sequence"].items()],
        "command": record.get("command"),
    }


def _transfer_field(record: dict, path: str, where: str, check, expected: str, required: bool = True):
    """``record[a][b]...`` for ``path = "a.b"``, checked by ``check`` (raises :class:`ModelCardError`)."""
    value = record
    walked = []
    for part in path.split("."):
        if not isinstance(value, dict):
            raise ModelCardError(f"{where}: '{'.'.join(walked)}' must be an object, got {type(value).__name__}")
        walked.append(part)
        if part not in value:
            if not required:
                return None
            raise ModelCardError(f"{where}: '{path}' is missing (not an attention_transfer.json of hf-performer distill?)")
        value = value[part]
    if not required and value is None:
        return None
    if not check(value):
        raise ModelCardError(f"{where}: '{path}' must be {expected}, got {value!r}")
    return value


def _layer_losses(losses: dict, path: str, where: str) -> dict[int, dict]:
    """``{layer: {"weights_kl": ..., ...}}`` from ``transfer.layer_losses_*`` (JSON keys are strings)."""
    parsed = {}
    for key, entry in losses.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ModelCardError(f"{where}: '{path}' keys must be layer indices, got {key!r}") from None
        if not isinstance(entry, dict):
            raise ModelCardError(f"{where}: '{path}.{key}' must be an object, got {entry!r}")
        for name in ("weights_kl", "output_squared_error"):
            if entry.get(name) is not None and not _is_number(entry[name]):
                raise ModelCardError(f"{where}: '{path}.{key}.{name}' must be a number, got {entry[name]!r}")
        parsed[layer] = entry
    return parsed


def _fidelity_layers(record: dict, name: str, where: str) -> dict[int, dict]:
    layers = _transfer_field(record, f"{name}.layers", where, lambda v: isinstance(v, list) and len(v) > 0,
                             "a non-empty list of layers")
    parsed = {}
    for index, entry in enumerate(layers):
        if not (isinstance(entry, dict) and isinstance(entry.get("layer"), int) and not isinstance(entry["layer"], bool)
                and _is_number(entry.get("own_inputs_relative_error"))):
            raise ModelCardError(
                f"{where}: '{name}.layers[{index}]' must hold an int 'layer' and a number "
                f"'own_inputs_relative_error', got {entry!r}"
            )
        parsed[entry["layer"]] = entry
    return parsed


def _format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds:.1f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def _format_number(value) -> str:
    return "–" if value is None else f"{value:.4f}"


def transfer_context(record: dict, where: str | None = None, feature_map: str | None = None) -> dict:
    """What the card's "Attention transfer" section shows, read from an ``attention_transfer.json`` record.

    Checked (a :class:`ModelCardError` names the first bad field): ``data`` (``file``, ``layout``, ``sequences``,
    ``max_length``), ``transfer`` (``steps``, ``loss``, ``learning_rate``, ``layer_losses_before`` /
    ``layer_losses_after`` keyed by layer index), ``fidelity_before`` / ``fidelity_after`` (``layers`` with
    ``own_inputs_relative_error``, ``final_hidden_state_cosine``), ``wall_time_s``; ``feature_map``, when present,
    must be the folder's. Only the data file's base name is kept (no local path reaches the card), and neither
    ``source`` nor ``command`` is shown.
    """
    if where is None:
        from ..conversion.attention_transfer import TRANSFER_FILE_NAME as where
    if not isinstance(record, dict):
        raise ModelCardError(f"{where}: expected a JSON object, got {type(record).__name__}")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_str = lambda v: isinstance(v, str) and v != ""  # noqa: E731
    data_file = _transfer_field(record, "data.file", where, is_str, "a file name")
    layout = _transfer_field(record, "data.layout", where, is_str, "a string")
    sequences = _transfer_field(record, "data.sequences", where, is_int, "an int")
    max_length = _transfer_field(record, "data.max_length", where, is_int, "an int")
    batch_size = _transfer_field(record, "data.batch_size", where, is_int, "an int", required=False)
    fidelity_sequences = _transfer_field(record, "data.fidelity_sequences", where, is_int, "an int", required=False)
    steps = _transfer_field(record, "transfer.steps", where, is_int, "an int")
    loss = _transfer_field(record, "transfer.loss", where, is_str, "a string")
    learning_rate = _transfer_field(record, "transfer.learning_rate", where, _is_number, "a number")
    trained = _transfer_field(record, "transfer.layers", where,
                              lambda v: isinstance(v, list) and all(is_int(i) for i in v), "a list of layer indices",
                              required=False)
    is_dict = lambda v: isinstance(v, dict)  # noqa: E731
    losses_before = _layer_losses(_transfer_field(record, "transfer.layer_losses_before", where, is_dict, "an object"),
                                  "transfer.layer_losses_before", where)
    losses_after = _layer_losses(_transfer_field(record, "transfer.layer_losses_after", where, is_dict, "an object"),
                                 "transfer.layer_losses_after", where)
    before = _fidelity_layers(record, "fidelity_before", where)
    after = _fidelity_layers(record, "fidelity_after", where)
    cosine_before = _transfer_field(record, "fidelity_before.final_hidden_state_cosine", where, _is_number, "a number")
    cosine_after = _transfer_field(record, "fidelity_after.final_hidden_state_cosine", where, _is_number, "a number")
    logits_before = _transfer_field(record, "fidelity_before.logits_relative_error", where, _is_number, "a number",
                                    required=False)
    logits_after = _transfer_field(record, "fidelity_after.logits_relative_error", where, _is_number, "a number",
                                   required=False)
    wall_time = _transfer_field(record, "wall_time_s", where, lambda v: _is_number(v) and v >= 0,
                                "a number of seconds")
    recorded_map = _transfer_field(record, "feature_map", where, is_str, "a string", required=False)
    if feature_map is not None and recorded_map is not None and recorded_map != feature_map:
        raise ModelCardError(
            f"{where}: records attention transfer into the {recorded_map!r} feature map, but config.json uses "
            f"{feature_map!r}: the file does not belong to this model"
        )

    rows = []
    for layer in sorted(set(before) | set(after)):
        old, new = before.get(layer), after.get(layer)
        attention = (new or old).get("attention", "favor")
        if attention == "favor" and trained is not None and layer not in trained:
            attention = "favor (not trained)"
        kl_before = (losses_before.get(layer) or {}).get("weights_kl")
        kl_after = (losses_after.get(layer) or {}).get("weights_kl")
        rows.append({
            "layer": layer,
            "attention": attention,
            "error_before": _format_number(old and old["own_inputs_relative_error"]),
            "error_after": _format_number(new and new["own_inputs_relative_error"]),
            "kl_before": _format_number(kl_before),
            "kl_after": _format_number(kl_after),
        })
    return {
        "data_file": os.path.basename(data_file.replace("\\", "/").rstrip("/")) or data_file,
        "layout": layout,
        "sequences": sequences,
        "max_length": max_length,
        "batch_size": batch_size,
        "fidelity_sequences": fidelity_sequences,
        "steps": steps,
        "loss": loss,
        "loss_meaning": TRANSFER_LOSSES.get(loss, ""),
        "learning_rate": f"{learning_rate:g}",
        "layers_trained": trained,
        "wall_time": _format_duration(float(wall_time)),
        "rows": rows,
        "cosine_before": f"{cosine_before:.4f}",
        "cosine_after": f"{cosine_after:.4f}",
        "logits_before": None if logits_before is None else f"{logits_before:.4f}",
        "logits_after": None if logits_after is None else f"{logits_after:.4f}",
        "fidelity_after": record["fidelity_after"],
    }

