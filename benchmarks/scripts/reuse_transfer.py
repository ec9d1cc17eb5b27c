"""Start a ``hf-performer linearize`` run from the attention transfer of another run with the same transfer settings,
instead of repeating it (on a 2-core CPU the transfer is the longest stage: 72 minutes for SmolLM2-135M).

    hf-performer linearize SOURCE OUT ... --softmax-worst 5 --stop-after convert   # the new run's staging area
    python benchmarks/scripts/reuse_transfer.py .OUT.linearize --record DONE/linearize.json --model TRANSFERRED
    hf-performer linearize SOURCE OUT ... --softmax-worst 5                        # continues after the transfer

``--record`` is the finished run's ``linearize.json``, or the ``run.json`` of a staging area past its transfer (its
transfer stage is copied into the staging area's record, marked as reused) and ``--model`` the model that run's transfer wrote (``.DONE.linearize/transferred``, kept by
``--stop-after transfer``; the window-hybrid pipeline keeps it as its ``hybrid_transfer`` arm). The settings that
decide the transfer must be equal in both runs (refused otherwise, naming them); the staging area must hold the
convert stage only. The new run's record then reports the reused transfer's tokens and wall time as its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

TRANSFER_SETTINGS = ("max_train_chars", "feature_map", "nb_features", "feature_map_init", "window", "sinks",
                     "linear_tail", "softmax_layers", "transfer_steps", "transfer_length", "transfer_batch_size",
                     "transfer_learning_rate", "transfer_schedule", "mixed_precision", "seed")
"""Settings that decide what the transfer stage trains (besides the source model and the training files)."""


class ReuseError(ValueError):
    pass


def _load(path: str, what: str) -> dict:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ReuseError(f"cannot read {what} {path}: {error}") from None


def _names(paths) -> list[str]:
    return [os.path.basename(os.path.normpath(path)) for path in paths or []]


def reuse_transfer(staging: str, record_path: str, model: str) -> dict:
    """Write the transfer stage of ``record_path`` and the model ``model`` into the staging area ``staging``;
    returns the staging area's new record."""
    run_file = os.path.join(staging, "run.json")
    state = _load(run_file, "the staging area's record")
    record = _load(record_path, "the finished run's record")
    if set(state.get("stages", {})) != {"convert"}:
        raise ReuseError(f"{staging} holds the stages {sorted(state.get('stages', {}))}; it must hold only convert "
                         "(run the new command with --stop-after convert first)")
    transfer = (record.get("stages") or {}).get("transfer") or {}
    if transfer.get("status") != "done":
        raise ReuseError(f"{record_path}: its transfer stage did not run (status {transfer.get('status')!r})")
    new, done = state["settings"], record.get("settings") or {}
    # records written before a setting existed hold its value of that time
    defaults = {"softmax_layers": [], "feature_map_init": "identity", "mixed_precision": "no"}
    differing = [f"{key} {done.get(key, defaults.get(key))!r} (new run {new.get(key)!r})" for key in TRANSFER_SETTINGS
                 if json.dumps(done.get(key, defaults.get(key))) != json.dumps(new.get(key, defaults.get(key)))]
    if _names([new.get("source")]) != _names([done.get("source")]):
        differing.append(f"source {done.get('source')!r} (new run {new.get('source')!r})")
    if _names(new.get("train_files")) != _names(done.get("train_files")):
        differing.append(f"train_files {done.get('train_files')} (new run {_names(new.get('train_files'))})")
    if differing:
        raise ReuseError("the transfer settings differ: " + ", ".join(differing))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ReuseError(f"{model} is not a model folder (no config.json)")
    target = os.path.join(staging, "transferred")
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(model, partial)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    reused = json.loads(json.dumps(transfer))
    run_name = os.path.basename(os.path.dirname(os.path.abspath(record_path)))
    reused.setdefault("details", {})["reused_from"] = (
        f"the transfer stage of another run with the same transfer settings ({run_name}), copied by "
        "benchmarks/scripts/reuse_transfer.py")
    state["stages"]["transfer"] = reused
    temporary = run_file + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(state, handle, indent=2)
    os.replace(temporary, run_file)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("staging", metavar="STAGING", help="the new run's staging area (.OUT.linearize)")
    parser.add_argument("--record", required=True,
                        help="the finished run's linearize.json, or a staging area's run.json past its transfer")
    parser.add_argument("--model", required=True, help="the model the finished run's transfer stage wrote")
    args = parser.parse_args(argv)
    try:
        state = reuse_transfer(args.staging, args.record, args.model)
    except ReuseError as error:
        raise SystemExit(f"reuse_transfer: error: {error}") from None
    transfer = state["stages"]["transfer"]
    print(f"reuse_transfer: {args.staging} continues after a reused transfer ({transfer['tokens_seen']} tokens, "
          f"{transfer['wall_time_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
