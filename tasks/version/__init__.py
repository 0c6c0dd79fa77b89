"""Version step: `dvc commit` what a run produced, push it, write the run manifest."""

from tasks.version.stage import VersionSummary, version

__all__ = ["VersionSummary", "version"]
