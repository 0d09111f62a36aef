"""Build hook: copy the repository's `conf/` and `data/` into the package of a built wheel.

The checkout keeps them at the root (where Hydra users and reviewers look for them);
an installed wheel has no checkout, so `kimi_pipe/config.py` finds the copies beside
the package. Editable installs skip the copy and read the checkout directly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# (folder in the checkout, glob of what ships) -> kimi_pipe/<folder> in the wheel
BUNDLED = {"conf": "**/*.yaml", "data": "*.jsonl"}


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, pattern in BUNDLED.items():
            source = ROOT / folder
            files = sorted(p for p in source.glob(pattern) if p.is_file())
            if not files:
                raise SystemExit(f"error: {source} holds no {pattern}; is this a full checkout?")
            target = Path(self.build_lib) / "kimi_pipe" / folder
            shutil.rmtree(target, ignore_errors=True)
            for path in files:
                destination = target / path.relative_to(source)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, destination)


setup(cmdclass={"build_py": BuildPyWithConfigs})
