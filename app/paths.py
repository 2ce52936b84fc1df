"""Where moechat keeps its files (platformdirs), overridable with MOECHAT_HOME for tests and CI."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP = "moechat"


@dataclass(frozen=True)
class AppPaths:
    config: Path
    data: Path
    cache: Path
    log: Path

    @property
    def speeds(self) -> Path:
        """The speeds an auto CPU share was measured from, per machine (engine.cache.share_auto)."""
        return self.data / "speeds.json"

    def as_dict(self) -> dict[str, Path]:
        return {"config": self.config, "data": self.data, "cache": self.cache, "log": self.log}


def app_paths() -> AppPaths:
    home = os.environ.get("MOECHAT_HOME")
    if home:
        root = Path(home)
        return AppPaths(root / "config", root / "data", root / "cache", root / "log")
    return AppPaths(
        Path(platformdirs.user_config_dir(APP)),
        Path(platformdirs.user_data_dir(APP)),
        Path(platformdirs.user_cache_dir(APP)),
        Path(platformdirs.user_log_dir(APP)),
    )
