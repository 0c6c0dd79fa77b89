"""Fit the linear member on one rank of a torchrun job, as the training stage does before training:

    python -m fusion_model.launch --nproc_per_node 2 tests/linear_member_worker.py --data DIR --out DIR

Each rank builds the module of `tests/test_linear_member.py`'s configuration on the validated table DIR
(every rank fitting its share of the rows, fusion_model/rank_sums.py) and writes the members' weights and
report to OUT/rank-<RANK>.safetensors and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fusion_model.build import build_module  # noqa: E402
from fusion_model.config import TrainConfig  # noqa: E402
from fusion_model.data import ValidatedData  # noqa: E402
from fusion_model.processes import end_process  # noqa: E402


def config(validated: Path, **keys: object) -> TrainConfig:
    # refit: true, so a built module holds the selection's fit of the training rows (refit "linear" would
    # put the train + val fit in its buffers: tests/test_refit.py); the two-number bins' block is
    # tests/test_pair_bins.py's, the codes read as numbers tests/test_model.py's (beside their own codes on 96
    # rows they leave an ordinal fit so flat that where L-BFGS stops turns on the order two ranks add in)
    return TrainConfig.model_validate({"data_dir": validated, "image_size": 32, "hidden_sizes": [16, 16],
                                       "ensemble_size": 4, "text_buckets": 4096, "refit": True,
                                       "pair_bins": False, "codes_as_numbers": False, **keys})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, _, module = build_module(config(args.data), ValidatedData.read(args.data))
    tensors = {}
    for member, linear in module.model.linear_members().items():  # an ordinal label's multinomial one too
        tensors.update({f"{member}.weight.{b}": linear.weight(b).detach().clone().contiguous()
                        for b in module.linear_glm[member].weights})
        tensors[f"{member}.intercept"] = linear.intercept.detach().clone()
    rank = os.environ["RANK"]
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / f"rank-{rank}.safetensors"))
    (args.out / f"rank-{rank}.json").write_text(json.dumps(module.linear_report))


if __name__ == "__main__":
    main()
    end_process(0)  # its files are written: a rank's teardown aborting in gloo's destructors must not fail it
