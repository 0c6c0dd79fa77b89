"""The linear member (fusion_model/wide.py, wide_fit.py): the GLM over the network's own text n-grams and codes,
fitted before the deep half trains, its penalties chosen on validation, weighed in the members' mix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression

from fusion_model import heads
from fusion_model.build import build_module
from fusion_model.data import FusionDataset, ValidatedData
from fusion_model.glm_problem import GlmProblem
from fusion_model.rank_sums import RankSums
from fusion_model.wide_fit import L2_GRIDS, _walk, design
from tests.linear_member_worker import config as _config
from tests.validated_tables import make_validated

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def validated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_validated(tmp_path_factory.mktemp("linear"), n_train=96, n_val=48, n_test=16)


def _batch(data: ValidatedData, pre, df) -> dict[str, torch.Tensor]:  # noqa: ANN001
    ds = FusionDataset(df, pre, data.dataset_root, labels=data.labels(df))
    return {k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ds[0]}


def _nbsvm_scaled(block: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """NBSVM's features (Wang & Manning 2012): each column times 1 + |r|, r = log((p / |p|_1) / (q / |q|_1)),
    p and q one plus the rows of either class holding it, over the columns some row holds."""
    held = (block != 0).any(0)
    present = (block[:, held] != 0).astype(float)
    p, q = 1 + present[labels == 1].sum(0), 1 + present[labels == 0].sum(0)
    out = block.copy()
    out[:, held] *= 1 + np.abs(np.log(p / p.sum()) - np.log(q / q.sum()))
    return out


@pytest.mark.parametrize("gram_ratios", [True, False])
def test_the_fitted_member_is_scikit_learns_logistic_regression_on_the_same_features(validated: Path,
                                                                                      gram_ratios: bool) -> None:
    data = ValidatedData.read(validated)
    l2 = 0.5
    pre, _, module = build_module(_config(validated, gram_ratios=gram_ratios,
                                          linear_l2={"text": l2, "chars": l2, "categorical": l2, "numerical": l2}), data)
    model = module.model.eval()
    assert model.linear is not None
    batch = _batch(data, pre, data.train)
    x = design(model, batch)
    assert list(x) == ["text", "chars", "categorical", "numerical"]  # word and character grams apart
    labels = batch["label"].numpy()
    # with gram_ratios the member is the same regression on NBSVM's scaled grams, its weights scaled back
    features = np.hstack([_nbsvm_scaled(m.toarray(), labels) if gram_ratios and b in ("text", "chars")
                          else m.toarray() for b, m in x.items()])
    # two softmax logits with L2 on both are one logistic regression of their difference at half the
    # penalty: mean loss + l2 |w|^2 / n  ==  scikit-learn's C = 1 / l2 on the difference
    reference = LogisticRegression(C=1 / l2, tol=1e-10, max_iter=10_000).fit(features, labels)
    with torch.no_grad():
        linear = model.head_outputs(batch)[:, -1]  # the linear member's head: the last one
    ours = torch.softmax(linear, -1)[:, 1].numpy()
    theirs = reference.predict_proba(features)[:, 1]
    assert np.abs(ours - theirs).max() < 5e-3
    # ... and not a regression at another penalty, nor of the other kind of grams: their log odds land
    # measurably elsewhere (the tiny table's rows are nearly separable: probabilities near 0 and 1 tell little)
    log_odds = (linear[:, 1] - linear[:, 0]).numpy()
    unscaled = np.hstack([m.toarray() for m in x.values()])
    for c, other_features in ((0.5 / l2, features), (2 / l2, features),
                              (1 / l2, _nbsvm_scaled(unscaled, labels) if not gram_ratios else unscaled)):
        other = LogisticRegression(C=c, tol=1e-10, max_iter=10_000).fit(other_features, labels)
        assert np.abs(log_odds - other.decision_function(other_features)).max() > 0.2
    assert all(model.linear.weight(b).abs().sum() > 0 for b in x)


def test_penalties_left_unset_are_chosen_on_validation_and_recorded(validated: Path) -> None:
    data = ValidatedData.read(validated)
    _, _, module = build_module(_config(validated), data)
    report = module.linear_report
    tried = report["tried"]
    assert set(tried) == set(report["l2"]) == {"text", "chars", "categorical", "numerical"}
    for block, scores in tried.items():  # the chosen penalty: the lowest validation loss of those tried
        scores = {float(k): v for k, v in scores.items()}
        assert report["l2"][block] in L2_GRIDS[block] and min(scores, key=scores.get) == report["l2"][block]


def test_the_walk_finds_the_grid_minimum_without_trying_every_value() -> None:
    grid = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10_000.0)
    calls: list[float] = []

    def score(value: float) -> float:
        calls.append(value)
        return (np.log10(value) - 1) ** 2  # lowest at 10

    best, scores = _walk(grid, 3, score)
    assert best == 10.0 and scores[10.0] == 0.0
    assert len(calls) < len(grid) and len(set(calls)) == len(calls)
    assert _walk(grid, 3, lambda v: -v)[0] == 10_000.0  # to the end of the grid


def test_ordinal_labels_get_increasing_thresholds_and_the_member_joins_the_mix(tmp_path: Path) -> None:
    validated = make_validated(tmp_path, n_train=96, n_val=48, n_test=16, problem_type="ordinal")
    data = ValidatedData.read(validated)
    pre, _, module = build_module(_config(validated), data)
    model = module.model.eval()
    thresholds = model.linear.intercept
    assert thresholds.shape == (4,) and bool((thresholds[1:] > thresholds[:-1]).all())
    batch = _batch(data, pre, data.val)
    with torch.no_grad():
        raw = model.head_outputs(batch)
    # the deep heads, then the linear members: the cumulative link's and the multinomial one's
    assert raw.shape == (len(data.val), model.k + 2, 4)
    assert model.mixed == model.members + 2 and model.member_weights.shape == (model.mixed,)
    labels = batch["label"].numpy()
    for head in (-2, -1):  # words and codes carry part of the label (Age, a number, the rest): each follows it
        above = torch.sigmoid(raw[:, head])
        assert bool((above[:, 1:] <= above[:, :-1] + 1e-6).all())  # P(y > k) falls with k
        assert np.corrcoef(above.sum(1).numpy(), labels)[0, 1] > 0.5
    assert model.linear_classes.intercept.shape == (5,)  # a logit per class
    report = module.linear_report
    # the multinomial member walks the grams' penalties from where the cumulative link's walk ended, and takes
    # the other blocks' as it chose them
    assert set(report["classes"]["tried"]) == {"text", "chars"}
    assert all(str(report["l2"][b]) in tried for b, tried in report["classes"]["tried"].items())
    assert all(report["classes"]["l2"][b] == report["l2"][b] for b in ("categorical", "numerical"))
    assert set(report["classes"]["l2"]) == set(report["l2"])
    # refit "linear": both members fitted again on every labelled row, each at the penalties it chose
    _, _, refitted = build_module(_config(validated, refit="linear"), data)
    again = refitted.linear_report["refit"]
    assert again["rows"] == len(data.train) + len(data.val) and "tried" not in again["classes"]
    assert again["l2"] == report["l2"] and again["classes"]["l2"] == report["classes"]["l2"]
    _, _, plain = build_module(_config(validated, linear_multinomial=False), data)
    assert plain.model.linear_classes is None and plain.model.mixed == plain.model.members + 1
    assert "classes" not in plain.linear_report


def test_the_refit_of_a_table_without_a_block_starts_from_the_selections_fit(validated: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The penalties of blocks the table lacks stay null after the selection: the refit still starts from
    the selection's fit at the penalties it chose, without validation rows."""
    from fusion_model import wide_fit

    starts: list[bool] = []
    fit = wide_fit._fit

    def recorded(x, problem, l2, start=None):  # noqa: ANN001, ANN202
        starts.append(start is not None)
        return fit(x, problem, l2, start)

    monkeypatch.setattr(wide_fit, "_fit", recorded)
    data = ValidatedData.read(validated)
    _, _, module = build_module(_config(validated, modalities=["tabular"], refit="linear"), data)
    report = module.linear_report
    assert "text" not in report["l2"] and report["refit"]["l2"] == report["l2"]
    assert "val_loss" not in report["refit"] and starts[-1]  # no validation rows read; started from the fit


def test_the_portfolio_lists_each_linear_member_with_its_own_refit() -> None:
    from fusion_model.summary import linear_entries

    report = {"l2": {"text": 1.5}, "val_loss": 0.9, "tried": {"text": {}},
              "classes": {"l2": {"text": 0.5}, "val_loss": 0.8, "tried": {"text": {}}},
              "refit": {"l2": {"text": 1.5}, "rows": 10, "classes": {"l2": {"text": 0.5}, "train_loss": 0.4}}}
    assert linear_entries(report) == [
        {"linear": {"l2": {"text": 1.5}, "val_loss": 0.9, "refit": {"l2": {"text": 1.5}, "rows": 10}}},
        {"linear_classes": {"l2": {"text": 0.5}, "val_loss": 0.8, "refit": {"l2": {"text": 0.5}, "train_loss": 0.4}}}]
    assert linear_entries({"l2": {"text": 1.5}}) == [{"linear": {"l2": {"text": 1.5}}}]


def test_two_ordered_classes_get_no_multinomial_member() -> None:
    """With two classes the cumulative link and the multinomial GLM are one logistic model: fitted once."""
    from fusion_model.model import FusionModel

    shape = {"image_model": "test_resnet", "cat_cardinalities": [3, 4], "n_numeric": 0,
             "problem_type": "ordinal", "linear_member": True, "linear_multinomial": True, "modalities": ["tabular"]}
    assert FusionModel(num_classes=2, **shape).linear_classes is None
    three = FusionModel(num_classes=3, **shape)
    assert three.linear_classes is not None and three.mixed == three.members + 2


def test_cumulative_logits_of_class_logits_are_the_logits_of_the_summed_probabilities() -> None:
    z = torch.tensor([[0.3, -1.2, 2.0, 0.1], [5.0, -4.0, 0.0, -30.0]])
    p = z.softmax(1)
    above = torch.stack([p[:, k + 1:].sum(1) for k in range(3)], dim=1)
    np.testing.assert_allclose(heads.cumulative_logits(z).numpy(), torch.logit(above.double()).numpy(), rtol=1e-5,
                               atol=1e-5)


def test_masking_a_modality_masks_its_part_of_the_linear_member(validated: Path) -> None:
    data = ValidatedData.read(validated)
    pre, _, module = build_module(_config(validated, linear_l2={"text": 0.5, "chars": 0.5, "categorical": 0.5,
                                                                  "numerical": 0.5}),
                                  data)
    model = module.model.eval()
    batch = _batch(data, pre, data.val)
    with torch.no_grad():
        full = model.head_outputs(batch)[:, -1]
        both = model.head_outputs(batch, mask={"text", "tabular"})[:, -1]
        no_text = model.head_outputs(batch, mask={"text"})[:, -1]
    assert torch.allclose(both, model.linear.intercept.expand_as(both))
    assert not torch.allclose(no_text, full) and not torch.allclose(no_text, both)


def test_without_the_linear_member_the_model_has_no_extra_head(validated: Path) -> None:
    data = ValidatedData.read(validated)
    _, kwargs, module = build_module(_config(validated, linear_member=False), data)
    assert module.model.linear is None and module.model.mixed == module.model.members
    assert kwargs["linear_member"] is False and not hasattr(module, "linear_report")


def test_a_frequency_key_is_a_code_of_the_linear_member_alone(tmp_path: Path) -> None:
    """RescuerID (a `dataset.frequency` key of the preset, thousands of values on real rows) enters as the
    last code: the linear member's penalised one-hot reads it, the deep embeddings and wide code logits do not."""
    import pandas as pd

    validated = make_validated(tmp_path, n_train=96, n_val=48, n_test=16)
    for split in ("train", "val", "test"):
        table = pd.read_parquet(validated / f"{split}.parquet")
        # a few rescuers, one of whom places most of the fast adoptions
        table["RescuerID"] = np.where(table["AdoptionSpeed"] == 1, "r1", "r" + (table["row_id"] % 5).astype(str))
        table.to_parquet(validated / f"{split}.parquet")
    data = ValidatedData.read(validated)
    pre, kwargs, module = build_module(_config(validated), data)
    model = module.model
    assert pre.categorical_columns[-1] == "RescuerID" and pre.frequency_codes == ["RescuerID"]
    assert kwargs["linear_only_codes"] == 1
    deep = len(pre.categorical_columns) - 1
    assert len(model.tabular.embeddings) == len(model.category_logit.tables) == deep
    rescuers = pre.cardinalities[-1]
    assert model.linear.categorical_weight.shape[0] == sum(pre.cardinalities)
    rescuer_rows = model.linear.categorical_weight[-rescuers:]
    assert rescuer_rows.abs().sum() > 0  # fitted: the rescuer carries the label here
    without = build_module(_config(validated, frequency_codes=False), data)[0]
    assert "RescuerID" not in without.categorical_columns
    # the two-number bins (tests/test_pair_bins.py) come after it, codes of the linear member alone as well
    paired, kwargs, module = build_module(_config(validated, pair_bins=True), data)
    pairs = paired.pair_columns
    assert pairs and paired.categorical_columns[: len(pre.categorical_columns)] == pre.categorical_columns
    assert all(" × " in c for c in paired.categorical_columns[-pairs:])
    assert kwargs["linear_only_codes"] == 1 + pairs and len(module.model.tabular.embeddings) == deep
    assert module.model.linear.categorical_weight.shape[0] == sum(paired.cardinalities)


def test_the_refit_starts_from_the_selections_fit_and_reaches_the_same_optimum(validated: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import pandas as pd
    import scipy.optimize

    from fusion_model import wide_fit

    data = ValidatedData.read(validated)
    cfg = _config(validated, linear_l2={"text": 0.5, "chars": 1.5, "categorical": 0.5, "numerical": 1.5})
    pre, _, selection = build_module(cfg, data)
    glm = selection.linear_glm["linear"]
    # the same inputs: carried over unchanged
    same = wide_fit.carried_over(glm, pre, pre, selection.model)
    assert all(np.array_equal(same.weights[b], glm.weights[b]) for b in glm.weights)
    fits: list[tuple[int, float]] = []  # each fit's iterations and objective
    minimize = scipy.optimize.minimize

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        result = minimize(*args, **kwargs)
        fits.append((int(result.nit), float(result.fun)))
        return result

    monkeypatch.setattr(wide_fit.scipy.optimize, "minimize", counted)
    # validate's row ids are unique across the splits (this fixture's restart in each): the target encodings
    # find a training row's own value by them
    every = dataclasses.replace(data, train=pd.concat([data.train, data.val], ignore_index=True))
    modalities = selection.model.modalities
    pre_every, _, cold = build_module(cfg, every, modalities)
    _, _, warm = build_module(cfg, every, modalities, linear_start=(pre, selection.linear_glm))
    (cold_iterations, cold_objective), (warm_iterations, warm_objective) = fits
    assert warm_iterations <= cold_iterations and warm_objective < cold_objective  # further in no more steps
    start = wide_fit.carried_over(glm, pre, pre_every, warm.model)
    # a bucket both keep starts at the selection's weight; one only the refit keeps starts at zero
    rows_before, rows_after = pre.text_tables["rows"], pre_every.text_tables["rows"]
    both = np.flatnonzero((rows_before > 0) & (rows_after > 0))
    only_after = np.flatnonzero((rows_before == 0) & (rows_after > 0))
    assert len(both) and len(only_after)
    np.testing.assert_array_equal(start.weights["text"][rows_after[both]], glm.weights["text"][rows_before[both]])
    assert not start.weights["text"][rows_after[only_after]].any()
    batch = _batch(every, pre_every, every.train)
    with torch.no_grad():
        cold_p = torch.softmax(cold.model.eval().head_outputs(batch)[:, -1], -1)
        warm_p = torch.softmax(warm.model.eval().head_outputs(batch)[:, -1], -1)
    assert float((cold_p - warm_p).abs().max()) < 2e-3


def test_a_training_step_leaves_the_linear_member_out_at_the_same_loss(validated: Path) -> None:
    data = ValidatedData.read(validated)
    pre, _, module = build_module(_config(validated, linear_l2={"text": 0.5, "chars": 0.5, "categorical": 0.5,
                                                                 "numerical": 0.5}), data)
    batch = _batch(data, pre, data.train)
    model = module.model.eval()
    with torch.no_grad():
        full, without = model.head_outputs(batch), model.head_outputs(batch, linear=False)
    assert full.shape == without.shape and not without[:, -1].any() and full[:, -1].abs().sum() > 0
    assert torch.equal(full[:, :-1], without[:, :-1])
    assert torch.equal(model.loss(full, batch["label"]), model.loss(without, batch["label"]))


def test_inputs_no_row_holds_are_left_out_of_the_fit_and_stay_zero(validated: Path) -> None:
    import scipy.sparse as sp

    from fusion_model import wide_fit

    data = ValidatedData.read(validated)
    l2 = {"text": 0.5, "chars": 1.5, "categorical": 0.5, "numerical": 1.5}
    pre, _, module = build_module(_config(validated, linear_l2=l2), data)
    model = module.model
    x = design(model, _batch(data, pre, data.train))
    problem = GlmProblem(model, torch.as_tensor(data.labels(data.train)), {})
    held = {b: np.flatnonzero(np.diff(m.tocsc().indptr)) for b, m in x.items()}
    assert all(len(held[b]) < x[b].shape[1] for b in ("text", "chars"))  # the shared table: most rows unused
    fit = wide_fit._fit(x, problem, l2)
    # a fit of only the columns some row holds, as its own problem: the same optimum
    compact = wide_fit._fit({b: sp.csr_matrix(m[:, held[b]]) for b, m in x.items()}, problem, l2)
    for b in x:
        assert not np.delete(fit.weights[b], held[b], axis=0).any()
        np.testing.assert_allclose(fit.weights[b][held[b]], compact.weights[b], atol=1e-4)
    # a start with weight on an input no row holds (a bucket the selection kept, the refit's rows lack):
    # its optimum is zero, and the fit lands there
    start = wide_fit.Glm({b: w.copy() for b, w in fit.weights.items()}, fit.intercept.copy(), fit.loss)
    unused = np.setdiff1d(np.arange(x["text"].shape[1]), held["text"])[:10]
    start.weights["text"][unused] = 1.0
    again = wide_fit._fit(x, problem, l2, start)
    assert not again.weights["text"][unused].any()
    np.testing.assert_allclose(again.weights["text"], fit.weights["text"], atol=1e-4)


def test_the_penalties_are_compared_between_converged_fits(validated: Path) -> None:
    """Each fit of the walk starts from the one before: stopped early, it stays near its start, and the
    comparison would turn on where the walk came from. Every penalty tried scores as a fit from zeros."""
    from fusion_model import wide_fit

    data = ValidatedData.read(validated)
    pre, _, module = build_module(_config(validated), data)
    model, report = module.model, module.linear_report
    labels = torch.as_tensor(data.labels(data.train))
    problem = GlmProblem(model, labels, {})
    val_problem = GlmProblem(model, torch.as_tensor(data.labels(data.val)), {})
    x = design(model, _batch(data, pre, data.train))
    scales = wide_fit._gram_scales(model, x, labels.numpy(), problem.sums)  # the grams as the walk fitted them
    x, val = wide_fit._scaled(x, scales), wide_fit._scaled(design(model, _batch(data, pre, data.val)), scales)
    chosen: dict[str, float] = {}
    for block in ("text", "chars", "categorical", "numerical"):
        part = {b: x[b] for b in [*chosen, block]}
        for value, walked in report["tried"][block].items():
            cold = wide_fit._fit(part, problem, {**chosen, block: float(value)})
            assert abs(val_problem.loss(cold, {b: val[b] for b in part}) - walked) < 1e-3
        chosen[block] = report["l2"][block]


@pytest.mark.parametrize("problem_type", ["binary", "ordinal"])
def test_the_fits_preconditioner_is_the_loss_curvature(tmp_path: Path, problem_type: str) -> None:
    """Each unknown of a fit is scaled by its curvature where the fit starts, built from
    `GlmProblem.curvature`: the diagonal of the loss's Hessian in every row's logits and in the intercept."""
    validated = make_validated(tmp_path, n_train=24, n_val=8, n_test=8, problem_type=problem_type)
    data = ValidatedData.read(validated)
    l2 = {"text": 0.5, "chars": 0.5, "categorical": 0.5, "numerical": 0.5}
    _, _, module = build_module(_config(validated, linear_l2=l2), data)
    problem = GlmProblem(module.model, torch.as_tensor(data.labels(data.train)), {})
    intercept = problem.initial_intercept() + 0.3
    z = torch.randn((len(data.train), problem.width), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows, own = problem.curvature(z.numpy(), intercept)
    b = torch.as_tensor(intercept, dtype=torch.float64)
    in_logits = torch.autograd.functional.hessian(lambda v: problem._loss(v.view_as(z), b), z.flatten())
    in_intercept = torch.autograd.functional.hessian(lambda v: problem._loss(z, v), b)
    assert rows.shape == z.shape and (rows > 0).all()
    np.testing.assert_allclose(rows.ravel(), torch.diagonal(in_logits).numpy(), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(own, torch.diagonal(in_intercept).numpy(), rtol=1e-6, atol=1e-12)


def test_every_row_is_one_ranks_share() -> None:
    for size in (1, 2, 3, 4):
        for rows in (0, 1, 5, 96, 97):
            shares = []
            for rank in range(size):
                sums = RankSums()
                sums.rank, sums.size = rank, size
                shares.append(np.arange(rows)[sums.share(rows)])
            assert np.array_equal(np.concatenate(shares), np.arange(rows))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("problem_type", ["binary", "ordinal"])
def test_ranks_fitting_their_shares_of_the_rows_get_the_fit_of_all_of_them(tmp_path: Path, problem_type: str) -> None:
    """Two torchrun ranks each build and fit half the rows, their losses and gradients summed by a gloo group
    of the member's own: both hold the very same member, and it is the one process's fit of every row."""
    validated = make_validated(tmp_path / "table", n_train=96, n_val=48, n_test=16, problem_type=problem_type)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks"
    cmd = [sys.executable, "-m", "fusion_model.launch", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(ROOT / "tests/linear_member_worker.py"), "--data", str(validated),
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [load_file(str(out / f"rank-{r}.safetensors")) for r in (0, 1)]
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    assert reports[0].pop("fit_wall_s") > 0 and reports[1].pop("fit_wall_s") > 0 and reports[0] == reports[1]

    data = ValidatedData.read(validated)
    pre, _, module = build_module(_config(validated), data)  # one process, every row
    alone = module.linear_report
    assert reports[0]["l2"] == alone["l2"] and reports[0]["tried"].keys() == alone["tried"].keys()
    # each fit stops where an iteration gains less than FTOL of the objective: on this table's ordinal fit (a
    # number that predicts almost every label, at the grid's lowest penalty) where the two stop, their sums
    # added in another order, moves the losses by ~2e-4
    assert abs(reports[0]["val_loss"] - alone["val_loss"]) < 5e-4
    assert abs(reports[0]["train_loss"] - alone["train_loss"]) < 5e-4
    # the same member, to the fits' tolerance: its logits on the validation rows (weights a large penalty
    # leaves near zero are where that tolerance shows most; the logits are what the member is)
    x = design(module.model, _batch(data, pre, data.val))
    members = module.model.linear_members()
    assert list(members) == (["linear", "linear_classes"] if problem_type == "ordinal" else ["linear"])
    if problem_type == "ordinal":
        assert reports[0]["classes"]["l2"] == alone["classes"]["l2"]
    for name, linear in members.items():
        ours = sum(m @ ranks[0][f"{name}.weight.{b}"].double().numpy() for b, m in x.items())
        theirs = sum(m @ linear.weight(b).double().numpy() for b, m in x.items())
        if name == "linear_classes":
            # a softmax over five classes of 96 rows is flatter still: where the two fits stop moves its logits
            # by ~1%, its class probabilities (what it is; its logits count up to a constant per row) by < 0.005
            ours, theirs = (torch.softmax(torch.tensor(z + b.double().numpy()), 1).numpy()
                            for z, b in ((ours, ranks[0][f"{name}.intercept"]), (theirs, linear.intercept)))
            assert np.abs(ours - theirs).max() < 0.01 and theirs.max() > 0.5
            continue
        scale = np.abs(theirs).max()
        assert scale > 0.1 and np.abs(ours - theirs).max() < 5e-3 * scale
        intercept = linear.intercept.numpy()
        assert np.abs(ranks[0][f"{name}.intercept"].numpy() - intercept).max() < 5e-3 * max(1.0, np.abs(intercept).max())
