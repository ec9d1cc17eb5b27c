"""The staging area of ``hf-performer linearize`` (:mod:`.linearize`): the folder of a run's stages and its record,
continued by a rerun with the same settings."""

from __future__ import annotations

import json
import os
import shutil

from .arguments import RecipeError

RUN_FILE = "run.json"
"""The staging area's record: the run's settings and the finished stages (what a resumed run reads)."""


class StagingArea:
    """The folder of a run's stages (``converted/``, ``transferred/``, ``lora/``, ``final/``, :data:`RUN_FILE`)."""

    def __init__(self, path: str):
        self.path = path

    def file(self, *names: str) -> str:
        return os.path.join(self.path, *names)

    def read(self) -> dict | None:
        try:
            with open(self.file(RUN_FILE)) as handle:
                return json.load(handle)
        except FileNotFoundError:
            return None

    def write(self, state: dict) -> None:
        """Write :data:`RUN_FILE` atomically (a killed run never leaves it half-written)."""
        temporary = self.file(RUN_FILE + ".tmp")
        with open(temporary, "w") as handle:
            json.dump(state, handle, indent=2)
        os.replace(temporary, self.file(RUN_FILE))


def open_staging_area(path: str, settings: LinearizeSettings) -> tuple[StagingArea, dict]:
    """The staging area at ``path``: a new one, or the one of an interrupted run with the same settings (one where no
    stage finished is replaced).

    Raises:
        RecipeError: the folder holds a run with other settings (naming them), or is not a staging area.
    """
    area = StagingArea(path)
    state = area.read()
    if state is None:
        if os.path.isdir(path) and os.listdir(path):
            raise RecipeError(f"{path} exists but is not a linearize staging area; remove it or pass --overwrite")
        os.makedirs(path, exist_ok=True)
        state = {"settings": settings.identity(), "stages": {}}
        area.write(state)
        return area, state
    recorded, current = state["settings"], settings.identity()
    differing = [f"{key} {recorded.get(key)!r} (now {current.get(key)!r})" for key in sorted(set(recorded) | set(current))
                 if json.dumps(recorded.get(key)) != json.dumps(current.get(key))]
    if differing and not state["stages"]:  # nothing finished there: nothing to continue, start this run instead
        shutil.rmtree(path)
        return open_staging_area(path, settings)
    if differing:
        raise RecipeError(f"an interrupted run with other settings is staged in {path}: {', '.join(differing)}; "
                          "rerun with its settings to continue it, or pass --overwrite to start over")
    return area, state
