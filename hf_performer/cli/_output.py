"""Output folders of ``hf-performer convert`` / ``distill`` / ``quickstart``: checked before any work, written to a
temporary folder beside the output and moved into place only once complete.

* :func:`check_output_folder`: refuses an output that is, contains or lies inside SOURCE, an existing one without
  ``--overwrite``, an unwritable parent; first puts right what interrupted runs left (:func:`recover_interrupted_runs`);
* :func:`staged_folder`: the staged write (following the umask), so a failure leaves nothing half-written and a
  killed run leaves folders the next one cleans up or restores;
* :func:`check_output_file`: an output file checked before any work (not a folder, its folder writable);
* :func:`public_command`: the command line a written record quotes, without local absolute paths;
* :func:`portable_evaluation_record`: an ``hf-performer evaluate`` record as written to a file, without them either.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
import tempfile


def check_output_folder(output: str, overwrite: bool, command: str, source: str | None = None) -> str:
    """The absolute path of an output folder, checked before any work, with ``hf-performer COMMAND: error: ...``.

    Refuses an output that is, contains or lies inside the local ``source`` folder (symlinks resolved), an existing
    one without ``overwrite``, and a parent folder that is missing or not writable. First recovers what an
    interrupted earlier run left beside it (see :func:`recover_interrupted_runs`).
    """
    path = os.path.abspath(output)
    parent = os.path.dirname(path)
    if source is not None and os.path.exists(source):
        _check_not_source(output, source, command)
    if not os.path.isdir(parent):
        raise SystemExit(f"hf-performer {command}: error: the parent folder of {output} does not exist")
    for note in recover_interrupted_runs(path):
        print(f"hf-performer {command}: {note}", file=sys.stderr)
    if os.path.lexists(path) and not overwrite:
        raise SystemExit(f"hf-performer {command}: error: {output} already exists; pass --overwrite to replace it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.check-", dir=parent))
    except OSError as error:
        raise SystemExit(
            f"hf-performer {command}: error: cannot write into {parent} (the folder of OUTPUT): {error.strerror}"
        ) from None
    return path


def _check_not_source(output: str, source: str, command: str) -> None:
    real_output, real_source = os.path.realpath(os.path.abspath(output)), os.path.realpath(source)
    if real_output == real_source:
        problem = "is the source folder"
    elif real_output.startswith(real_source.rstrip(os.sep) + os.sep):
        problem = "is inside the source folder"
    elif real_source.startswith(real_output.rstrip(os.sep) + os.sep):
        problem = "contains the source folder"
    else:
        return
    raise SystemExit(
        f"hf-performer {command}: error: OUTPUT {output} {problem} {source}; writing it would overwrite the source: "
        "choose an OUTPUT outside SOURCE"
    )


_LEFTOVER = re.compile(r"^\.(?P<base>.+)\.(?P<kind>partial|old)-(?:(?P<pid>\d+)-)?[^-]*$")
"""Names of :func:`staged_folder`'s folders beside the output: ``.NAME.partial-PID-XXXX`` (being written) and
``.NAME.old-PID-XXXX`` (the previous output, moved aside while the new one is moved in)."""


def recover_interrupted_runs(output: str) -> list[str]:
    """Put right what dead runs writing ``output`` left beside it; returns one note per action, for the user.

    A run that died between its two renames (output -> ``.old-``, ``.partial-`` -> output) left no output: its
    ``.old-`` folder is restored, so the replacement is all or nothing. Other ``.partial-`` / ``.old-`` folders of
    dead processes are removed. Those of running processes (another conversion into the same folder) are left
    alone; those without a process id (older versions, other machines) are only named.
    """
    parent, base = os.path.split(output)
    notes = []
    leftovers = [(name, _LEFTOVER.match(name)) for name in sorted(os.listdir(parent))]
    leftovers = [(name, match) for name, match in leftovers if match and match["base"] == base]
    # Restore a retired output before deleting anything.
    for name, match in sorted(leftovers, key=lambda item: item[1]["kind"] != "old"):
        leftover = os.path.join(parent, name)
        if match["pid"] is None:
            notes.append(f"left {name} (an unfinished earlier run?): delete it if no run is writing {base}")
        elif _process_is_running(int(match["pid"])):
            continue
        elif match["kind"] == "old" and not os.path.lexists(output):
            os.replace(leftover, output)
            notes.append(f"restored {base} from {name}, where a run interrupted while replacing it had moved it")
        else:
            _remove(leftover)
            notes.append(f"removed {name}, left by an interrupted run")
    return notes


def _process_is_running(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _current_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def staged_folder(output: str):
    """Yield a temporary folder beside ``output``; when the block succeeds, move it into place (replacing an existing
    ``output`` only at the last moment); when it fails, delete it. A failure never leaves a half-written folder, and
    a run killed midway leaves folders that :func:`recover_interrupted_runs` puts right."""
    parent, name = os.path.split(output)
    staging = tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=parent)
    try:
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp makes it 0700; save_pretrained follows the umask
        yield staging
        _replace_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_folder(staging: str, output: str) -> None:
    """Move the complete ``staging`` folder to ``output``, replacing an existing one only at the last moment."""
    if not os.path.lexists(output):
        os.replace(staging, output)
        return
    parent, name = os.path.split(output)
    retired = tempfile.mkdtemp(prefix=f".{name}.old-{os.getpid()}-", dir=parent)
    os.rmdir(retired)
    os.replace(output, retired)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(retired, output)
        raise
    _remove(retired)


def _remove(path: str) -> None:
    """Delete a folder (not what a symlink points to) or a file."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def write_reconfigured_model(output: str, source: str, model, tokenizer, record_file: str, record: dict) -> None:
    """Write ``model`` (the weights of the folder ``source`` with other settings) staged into ``output``: with its
    tokenizer, ``record`` as ``record_file``, the source's training record (``linearize.json``: the same weights) and
    a card (``hf-performer budget`` / ``settings``)."""
    import json

    from ..hub import write_model_card
    from ..recipes.linearize import LINEARIZE_FILE

    with staged_folder(output) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, record_file), "w") as handle:
            json.dump(record, handle, indent=2)
        if os.path.isfile(os.path.join(source, LINEARIZE_FILE)):
            shutil.copyfile(os.path.join(source, LINEARIZE_FILE), os.path.join(staging, LINEARIZE_FILE))
        write_model_card(staging, model_name=os.path.basename(output))


def check_output_file(path: str, command: str) -> str:
    """The absolute path of an output file, checked before any work (``hf-performer COMMAND: error: ...``): not a
    folder, and its folder exists or can be created in a writable one."""
    absolute = os.path.abspath(path)
    if os.path.isdir(absolute):
        raise SystemExit(f"hf-performer {command}: error: --output {path} is a folder; give a file name (e.g. "
                         f"{os.path.join(path, 'metrics.json')})")
    existing = os.path.dirname(absolute)
    while not os.path.isdir(existing):
        if os.path.exists(existing):
            raise SystemExit(f"hf-performer {command}: error: --output {path}: {existing} is a file, not a folder")
        existing = os.path.dirname(existing)
    target = absolute if os.path.exists(absolute) else existing
    if not os.access(target, os.W_OK) or not _can_write(target):
        raise SystemExit(f"hf-performer {command}: error: --output {path}: {target} is not writable")
    return absolute


def _can_write(target: str) -> bool:
    """Whether a file can be written at ``target`` (an existing file, opened for appending: unchanged) or in it (a
    folder: a probe file made and removed). Permission bits alone mislead where the process runs as root on a
    read-only mount."""
    try:
        if os.path.isdir(target):
            with tempfile.NamedTemporaryFile(dir=target):
                pass
        else:
            with open(target, "a"):
                pass
    except OSError:
        return False
    return True


def public_command(verb: str) -> str | None:
    """``hf-performer VERB ...`` as typed, for a record that may be shared (benchmark JSON, distill record): absolute
    paths become base names, relative ones stay; ``None`` when the process was not started as ``hf-performer VERB``
    (e.g. :func:`hf_performer.cli.main` called from Python with its own ``argv``)."""
    verb_words = verb.split()
    if sys.argv[1:1 + len(verb_words)] != verb_words:
        return None
    arguments = [os.path.basename(os.path.normpath(argument)) if os.path.isabs(os.path.expanduser(argument))
                 else argument for argument in sys.argv[1 + len(verb_words):]]
    return shlex.join(["hf-performer", *verb_words, *arguments])


def portable_evaluation_record(record: dict, output: str) -> dict:
    """``record`` (``hf-performer evaluate``'s) as its ``--output`` file stores it: the local model folder relative
    to the file's folder (``.`` when the file is inside it; readers resolve it from there), a local data file by its
    base name, a Hub id or ``hub:...`` name as it is, and the command as typed (:func:`public_command`)."""
    portable = dict(record)
    model = record.get("model")
    if isinstance(model, str) and (os.path.isabs(model) or os.path.exists(model)):
        portable["model"] = os.path.relpath(os.path.abspath(model), os.path.dirname(os.path.abspath(output)))
    data = record.get("data")
    if isinstance(data, str) and (os.path.isabs(data) or os.path.exists(data)):
        portable["data"] = os.path.basename(os.path.normpath(data))
    command = public_command("evaluate")
    if command is not None:
        portable["command"] = command
    return portable
