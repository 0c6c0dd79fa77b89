"""Names of the files a training run writes and a converted model folder holds (one place for each)."""

from __future__ import annotations

# beside the checkpoints (the train stage's out_dir)
MODEL_CONFIG = "model_config.json"  # rebuilds the model and its preprocessing: fusion_model.predict.build_model
TRAIN_SUMMARY = "train_summary.json"
BEST_CHECKPOINT = "best.ckpt"  # a file (ddp, ddp_spawn) or a DeepSpeed ZeRO folder
LAST_CHECKPOINT = "last.ckpt"
LIVE_DIR = "dvclive"  # DVCLive's log of the run (metrics.json, plots/metrics/*.tsv), moved to train.live_dir
CURVES = "curves.png"  # loss and validation metric per epoch, drawn from that log
RANKS_DIR = "ranks"  # across hosts: rank-<global rank>.json, one per rank that trained into this folder
# a converted model folder: everything prediction needs
WEIGHTS = "model.safetensors"
CONVERSION_MANIFEST = "manifest.json"
MODEL_FILES: tuple[str, ...] = (WEIGHTS, MODEL_CONFIG, CONVERSION_MANIFEST)
# state-dict key prefixes of a training checkpoint: the LightningModule keeps the FusionModel as `model`,
# and DeepSpeed's engine wraps Lightning's module wrapper, whose `_forward_module` is the LightningModule
MODEL_PREFIX = "model."
DEEPSPEED_PREFIX = "_forward_module."
CANDIDATES_DIR = "candidates"  # train.candidates: <i>/ (candidate i > 0: checkpoints, DVCLive log) and <i>.json (its selection)
