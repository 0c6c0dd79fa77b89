"""Score stage: new rows scored with the champion, each drop's predictions, rejects and manifest written whole."""

from tasks.score.stage import OUTPUT_FILES, DropScore, ScoreRefused, ScoreSummary, score

__all__ = ["OUTPUT_FILES", "DropScore", "ScoreRefused", "ScoreSummary", "score"]
