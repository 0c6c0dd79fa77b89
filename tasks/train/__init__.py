"""Train stage: launches the per-rank entry point (`python -m fusion_model.fit`) as its own process group."""

from tasks.train.stage import TrainSummary, train

__all__ = ["TrainSummary", "train"]
