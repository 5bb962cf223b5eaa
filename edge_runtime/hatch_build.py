"""Build hook: a regular rtgw-edge wheel takes its modules from the repository's own packages.

The modules listed in ``[tool.hatch.build.targets.wheel.hooks.custom] modules`` (paths relative to
the repository root) go into the wheel at the same paths. Editable installs take nothing here:
``dev-mode-dirs`` puts the repository on the path instead, so the sources are never copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version != "standard":
            return
        repo = Path(self.root).parent
        for module in self.config["modules"]:
            source = repo / module
            if not source.is_file():
                raise FileNotFoundError(f"rtgw-edge lists {module}, which is not in the repository")
            build_data["force_include"][str(source)] = module
