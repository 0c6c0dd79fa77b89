"""Download stage: the dataset folder from a source (`synthetic`, the embedded generator; `url`, the zip)."""

from tasks.download.stage import DownloadSummary, download

__all__ = ["DownloadSummary", "download"]
