"""The linear member fitted before the deep half trains: a penalised linear model (a GLM) over the text
n-grams, the codes and the numbers' piecewise-linear encodings, full batch, to convergence.

Trained by Adam with the rest for a few epochs, linear text and code logits stop short of the optimum of
the same linear model fitted to convergence (each rare n-gram gets a few noisy updates): on real reviews
the network's validation AUC was ~0.01 below a logistic regression on the very same features
(BENCHMARKS.md). So the training stage fits `LinearMember` (fusion_model/wide.py) first, on the training
rows, with an L2 penalty per block of inputs chosen on the validation rows (or given), and the validation
mix weighs it beside the deep members each epoch. It sees what the network sees, nothing of any other model.

scipy computes the sparse products and runs L-BFGS; torch computes the problem type's loss on the logits
(fusion_model/glm_problem.py, heads.py), so the GLM optimises exactly the network's loss. Written here because
no library fits a linear model with the network's own losses (a cumulative link for ordinal labels among them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import scipy.optimize
import scipy.sparse as sp
import torch

from fusion_model.config import TrainConfig
from fusion_model.data import ValidatedData
from fusion_model.glm_problem import Design, Glm, GlmProblem, logits
from fusion_model.gram_ratios import gram_scales, label_classes
from fusion_model.model import FusionModel
from fusion_model.preprocess import Preprocessor
from fusion_model.rank_sums import RankSums, rank_sums
from fusion_model.wide import LINEAR_BLOCKS, LinearMember, bag_entries

# penalties tried on the validation rows (L2 per training row: logistic regression's 1 / (2 C)), per block
L2_GRIDS = {
    "text": (0.05, 0.15, 0.5, 1.5, 5.0),
    "chars": (0.15, 0.5, 1.5, 5.0, 15.0, 50.0, 150.0),
    "categorical": (0.15, 0.5, 1.5, 5.0, 15.0, 50.0, 150.0),
    "numerical": (0.15, 0.5, 1.5, 5.0, 15.0, 50.0, 150.0),
    # coarser, up to a penalty that leaves the two-number bins out in effect where the table holds no crossing
    "pairs": (0.15, 1.5, 15.0, 150.0, 1500.0),
}
# L-BFGS stops when an iteration lowers the objective by less than this share; the penalties are compared
# between fits this converged: stopped at 1e-5, a fit started from the one before stays near it, and which
# penalty won turned on the float order of the machine (BENCHMARKS.md)
FTOL = 1e-6
MAX_ITER = 300
# the blocks whose penalty the multinomial member walks for itself: the grams'. The codes', the two-number bins'
# and the numbers' it takes as the cumulative link chose them: walked too, they lengthened the fit and scored
# no better on any real split measured (BENCHMARKS.md)
CLASSES_WALK = ("text", "chars")


def design(model: FusionModel, batch: dict[str, torch.Tensor], pair_codes: int = 0) -> Design:
    """The linear member's inputs as sparse matrices, block by block, exactly as its forward computes them;
    the last `pair_codes` code columns (the two-number bins) as a block of their own."""
    assert model.linear is not None
    dense = model.linear.inputs(getattr(model, "text", None), batch, split_chars=True)
    out: Design = {}
    for name, value in dense.items():
        if name in ("text", "chars"):
            rows, weights = value
            flat, offsets, flat_weights = bag_entries(rows, weights)  # padding and the other kind of gram left out
            indptr = np.append(offsets.numpy(), len(flat))
            matrix = sp.csr_matrix((flat_weights.double().numpy(), flat.numpy(), indptr),
                                   shape=(rows.shape[0], model.linear.weight(name).shape[0]))
            matrix.sum_duplicates()  # two grams of a row hashed to one bucket
        elif name == "categorical":
            table = model.linear.weight(name).shape[0]
            codes = value.numpy()
            for block, part in (("categorical", codes[:, : codes.shape[1] - pair_codes]),
                                ("pairs", codes[:, codes.shape[1] - pair_codes:])):
                n, cols = part.shape
                if cols:
                    out[block] = sp.csr_matrix((np.ones(n * cols), (np.repeat(np.arange(n), cols), part.ravel())),
                                               shape=(n, table))
            continue
        else:
            matrix = sp.csr_matrix(value.double().numpy())
        out[name] = matrix
    return out


def _fit(x: Design, problem: GlmProblem, l2: dict[str, float], start: Glm | None = None) -> Glm:
    """Minimise mean loss + sum over blocks of l2 * |W_block|^2 / rows (binary's one fitted logit stands for
    the model's two, so its penalty counts twice), from `start` where it has a block. Only the inputs some row
    holds are optimised: the others' optimum is zero (most of the shared n-gram table is the other kind of
    gram, or under min_df), and L-BFGS-B's own work grows with every unknown. `x` holds this rank's rows:
    the ranks add their losses and gradients (`problem.sums`) and so take the same steps."""
    n, width, scale, sums = problem.rows, problem.width, problem.penalty_scale, problem.sums
    names = list(x)
    used = {b: np.flatnonzero(sums.sum(np.bincount(x[b].indices, minlength=x[b].shape[1]))) for b in names}
    held = {b: x[b][:, used[b]] for b in names}
    sizes = [len(used[b]) * width for b in names]
    cuts = np.concatenate([[0], np.cumsum(sizes)])
    theta0 = np.zeros(cuts[-1] + problem.n_intercept)
    theta0[cuts[-1]:] = problem.initial_intercept() if start is None else start.intercept
    for i, b in enumerate(names):
        if start is not None and b in start.weights:
            theta0[cuts[i]:cuts[i + 1]] = start.weights[b][used[b]].ravel()
    transposed = {b: held[b].T.tocsr() for b in names}

    def unpack(theta: np.ndarray) -> dict[str, np.ndarray]:
        return {b: theta[cuts[i]:cuts[i + 1]].reshape(-1, width) for i, b in enumerate(names)}

    # L-BFGS-B runs on the unknowns divided by `scaling`: 1 / sqrt of each one's curvature where the fit
    # starts, its penalty's included (a diagonal preconditioner: a rare n-gram, a code every row holds and
    # the intercept take like steps); measured at the start, not at zero weights, so that the rows a warm
    # start already fits well weigh less, as they do at the optimum (BENCHMARKS.md)
    rows, own = problem.curvature(logits(unpack(theta0), held, width), theta0[cuts[-1]:])
    diagonal = sums.sum(np.concatenate([*((held[b].multiply(held[b]).T @ rows).ravel() for b in names), own]))
    for i, b in enumerate(names):
        diagonal[cuts[i]:cuts[i + 1]] += 2 * scale * l2[b] / n
    scaling = np.where(diagonal > 0, diagonal, 1.0) ** -0.5

    def objective(scaled: np.ndarray) -> tuple[float, np.ndarray]:
        theta = scaled * scaling
        weights = unpack(theta)
        part, dz, db = problem.loss_and_grads(logits(weights, held, width), theta[cuts[-1]:])
        rows_part = np.empty(len(theta) + 1)  # this rank's rows' gradient and loss, summed across ranks at once
        for i, b in enumerate(names):
            rows_part[cuts[i]:cuts[i + 1]] = (transposed[b] @ dz).ravel()
        rows_part[cuts[-1]:-1], rows_part[-1] = db, part
        summed = sums.sum(rows_part)
        grad, loss = summed[:-1], float(summed[-1])
        for i, b in enumerate(names):
            w = weights[b]
            grad[cuts[i]:cuts[i + 1]] += (2 * scale * l2[b] / n * w).ravel()
            loss += scale * l2[b] / n * float((w * w).sum())
        return loss, grad * scaling

    done = scipy.optimize.minimize(objective, theta0 / scaling, jac=True, method="L-BFGS-B",
                                   options={"maxiter": MAX_ITER, "ftol": FTOL, "gtol": 1e-5})
    theta = done.x * scaling
    weights: dict[str, np.ndarray] = {}
    for b, w in unpack(theta).items():
        weights[b] = np.zeros((x[b].shape[1], width))
        weights[b][used[b]] = w
    penalty = scale * sum(l2[b] * float((w * w).sum()) for b, w in weights.items())
    return Glm(weights, theta[cuts[-1]:].copy(), float(done.fun) - penalty / n)


def _walk(grid: tuple[float, ...], start: int, score: Callable[[float], float]) -> tuple[float, dict[float, float]]:
    """The grid value of lowest `score`, walking from `start` towards lower scores until one is worse (the
    validation loss is near unimodal in the log of a penalty): 3-4 fits where the whole grid takes 5-7."""
    scores = {grid[start]: score(grid[start])}
    i = start
    for step in (-1, 1):
        j = i + step
        while 0 <= j < len(grid):
            scores[grid[j]] = score(grid[j])
            if scores[grid[j]] >= scores[grid[i]]:
                break
            i, j = j, j + step
        if i != start:  # improved in the first direction: the other side of start is worse
            break
    return grid[i], scores


def _choose_block(train: Design, val: Design, problem: GlmProblem, val_problem: GlmProblem, chosen: dict[str, float],
                  block: str, start: Glm | None, first: float | None) -> tuple[Glm, float, dict[float, float]]:
    """`block`'s penalty of lowest validation loss, fitted beside the blocks of `chosen` at theirs; the walk
    starts at `first` (where on the grid), else mid-grid."""
    fits: dict[float, Glm] = {}
    last = [start]  # each fit starts from the one before

    def score(value: float) -> float:
        last[0] = fits[value] = _fit(train, problem, {**chosen, block: value}, last[0])
        return val_problem.loss(fits[value], val)

    grid = L2_GRIDS[block]
    best, scores = _walk(grid, grid.index(first) if first in grid else len(grid) // 2, score)
    return fits[best], best, scores


def choose_penalties(train: Design, train_problem: GlmProblem, val: Design, val_problem: GlmProblem,
                     given: dict[str, float | None], first: dict[str, float] | None = None
                     ) -> tuple[Glm, dict[str, float], dict[str, dict[float, float]]]:
    """Each block's penalty with the lowest validation loss, block by block in LINEAR_BLOCKS order, each
    fitted beside the blocks before it at their chosen penalties, its walk started at `first`'s (another
    member's choice) where given; a penalty given is kept. Returns the fit of the chosen penalties, them,
    and the validation loss of every penalty tried."""
    chosen: dict[str, float] = {}
    tried: dict[str, dict[float, float]] = {}
    glm: Glm | None = None
    for block in [b for b in LINEAR_BLOCKS if b in train]:
        blocks = [*chosen, block]
        part_train, part_val = {b: train[b] for b in blocks}, {b: val[b] for b in blocks}
        if given.get(block) is not None:
            chosen[block] = float(given[block])  # type: ignore[arg-type]
            glm = _fit(part_train, train_problem, chosen, glm)
            continue
        glm, chosen[block], tried[block] = _choose_block(part_train, part_val, train_problem, val_problem, chosen,
                                                          block, glm, (first or {}).get(block))
    assert glm is not None
    return glm, chosen, tried


def carried_over(glm: Glm, before: Preprocessor, after: Preprocessor, model: FusionModel) -> Glm:
    """`glm` (fitted with `before`'s inputs) as a starting point in `after`'s: each n-gram bucket's and each
    code's weights where both preprocessors keep it, a number's where its bins are the same, zeros for the
    rest. The refit's preprocessor, fitted on more rows, keeps more of them; started there its L-BFGS gets
    nearer the same optimum in no more iterations than from zeros."""
    assert model.linear is not None
    out: dict[str, np.ndarray] = {}
    for block, w in glm.weights.items():
        new = np.zeros((model.linear.weight(block).shape[0], w.shape[1]))
        if block in ("text", "chars") and before.text_tables is not None and after.text_tables is not None:
            buckets = np.flatnonzero(after.text_tables["rows"])
            new[after.text_tables["rows"][buckets]] = w[before.text_tables["rows"][buckets]]
        elif block in ("categorical", "pairs"):  # one table: every code's row carried, the block's are not zero
            old_start = dict(zip(before.categorical_columns, _starts(before.cardinalities), strict=True))
            for column, start in zip(after.categorical_columns, _starts(after.cardinalities), strict=True):
                if column in old_start:
                    old_index = {v: i + 1 for i, v in enumerate(before.vocabularies[column])}
                    pairs = [(0, 0)] + [(i + 1, old_index[v]) for i, v in enumerate(after.vocabularies[column])
                                        if v in old_index]
                    new_rows, old_rows = (np.asarray(x) for x in zip(*pairs, strict=True))
                    new[start + new_rows] = w[old_start[column] + old_rows]
        elif block == "numerical":
            old_bins = dict(zip(before.numeric_columns, before.numeric_bins, strict=True))
            old_start = dict(zip(before.numeric_columns, _starts([len(e) - 1 for e in before.numeric_bins]),
                                 strict=True))
            starts = _starts([len(e) - 1 for e in after.numeric_bins])
            linear = model.linear.numeric_inputs  # the numbers it reads: the deep half's alone come after them
            for column, edges, start in zip(after.numeric_columns[:linear], after.numeric_bins[:linear],
                                            starts[:linear], strict=True):
                if column in old_bins and list(old_bins[column]) == list(edges):
                    new[start:start + len(edges) - 1] = w[old_start[column]:old_start[column] + len(edges) - 1]
        out[block] = new
    return Glm(out, glm.intercept.copy(), glm.loss)


def _starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive blocks of `sizes` rows starts."""
    return [int(x) for x in np.cumsum([0, *sizes])[:-1]]


def _gram_scales(model: FusionModel, x: Design, labels: np.ndarray, sums: RankSums) -> dict[str, np.ndarray]:
    """The text blocks' per-gram scales (fusion_model/gram_ratios.py) from the training rows' labels."""
    assert model.linear is not None
    n_classes = {"binary": 2, "multiclass": model.width,
                 "ordinal": model.linear.intercept.numel() + 1}.get(model.problem_type, 0)
    classes, n_classes = label_classes(labels, n_classes, sums)
    return {b: gram_scales(x[b], classes, n_classes, sums) for b in ("text", "chars") if b in x}


def _scaled(x: Design, scales: dict[str, np.ndarray]) -> Design:
    return {b: (m @ sp.diags(scales[b])).tocsr() if b in scales else m for b, m in x.items()}


def _scaled_glm(glm: Glm, scales: dict[str, np.ndarray], power: int) -> Glm:
    """`glm`'s weights times (power 1) or divided by (-1) their inputs' scales."""
    return Glm({b: w * scales[b][:, None] ** power if b in scales else w for b, w in glm.weights.items()},
               glm.intercept, glm.loss)


def fit_linear(model: FusionModel, batch: dict[str, torch.Tensor], labels: torch.Tensor, *,
               l2: dict[str, float | None], loss_kwargs: dict | None = None,
               val_batch: dict[str, torch.Tensor] | None = None, val_labels: torch.Tensor | None = None,
               start: dict[str, Glm] | None = None, sums: RankSums | None = None, pair_codes: int = 0,
               gram_ratios: bool = True, classes_l2: dict[str, float | None] | None = None
               ) -> tuple[dict, dict[str, Glm]]:
    """Fit the model's linear members on `batch` (a block's penalty left None is chosen on `val_batch`; with
    every penalty given, from `start`'s fit of the member) and write them into their buffers; returns the
    penalties used, the losses and the penalties tried (an ordinal label's multinomial member's under
    "classes", its own penalties `classes_l2`, its walk started at the cumulative link's choice), and the
    fits by member. With `sums` across ranks, the batches are this rank's share of the rows and every rank
    gets the fit of all of them. `gram_ratios`: the n-grams weighed by their naive Bayes log-count ratios in
    the fit (fusion_model/gram_ratios.py)."""
    members = model.linear_members()
    if not members:
        return {}, {}
    kwargs, sums = loss_kwargs or {}, sums or RankSums()
    train = design(model, batch, pair_codes)
    val = design(model, val_batch, pair_codes) if val_batch is not None else None
    # fitted on the scaled grams, the weights then scaled back: the same logits, a penalty per gram
    scales = _gram_scales(model, train, labels.numpy(), sums) if gram_ratios else {}
    report_val = val
    train, val = _scaled(train, scales), _scaled(val, scales) if val is not None else None
    report: dict = {}
    fits: dict[str, Glm] = {}
    for member, given in (("linear", l2), ("linear_classes", classes_l2 or {})):
        if member not in members:
            continue
        problem = GlmProblem(model, labels, kwargs, sums, member)
        val_problem = GlmProblem(model, val_labels, kwargs, sums, member) if val_labels is not None else None
        given = {b: given.get(b) for b in train}
        if member == "linear_classes":
            given = {b: report["l2"][b] if v is None and b not in CLASSES_WALK else v for b, v in given.items()}
        unset = [b for b in train if given[b] is None]
        tried: dict[str, dict[float, float]] = {}
        if unset:
            if val is None or val_problem is None:
                raise ValueError(f"the {member} member's penalties {unset} are unset: choosing them needs validation "
                                 "rows")
            glm, chosen, tried = choose_penalties(train, problem, val, val_problem, given, report.get("l2"))
        else:
            chosen = {b: float(given[b]) for b in train}  # type: ignore[arg-type]
            member_start = (start or {}).get(member)
            glm = _fit(train, problem, chosen, _scaled_glm(member_start, scales, -1) if member_start else None)
        fits[member] = glm = _scaled_glm(glm, scales, 1)
        _store(members[member], problem, glm)
        part: dict = {"l2": chosen, "train_loss": round(glm.loss, 5)}
        if report_val is not None and val_problem is not None:
            part["val_loss"] = round(val_problem.loss(glm, report_val), 5)
        if tried:
            part["tried"] = {b: {str(v): float(f"{s:.6g}") for v, s in d.items()} for b, d in tried.items()}
        if member == "linear":
            report.update(part)
        else:
            report["classes"] = part
    return report, fits


def _store(linear: LinearMember, problem: GlmProblem, glm: Glm) -> None:
    """`glm` written into the member's buffers (the word and character grams' blocks share one table:
    zeroed, then each added)."""
    with torch.no_grad():
        for name in glm.weights:
            linear.weight(name).zero_()
        for name, w in glm.weights.items():
            linear.weight(name).add_(torch.from_numpy(problem.model_weights(w)).to(linear.weight(name).dtype))
        linear.intercept.copy_(torch.from_numpy(problem.thresholds(glm.intercept)))


def fit_linear_member(model: Any, pre: Preprocessor, data: ValidatedData, labels: np.ndarray, cfg: TrainConfig,
                      start: tuple[Preprocessor, dict[str, Glm]] | None = None) -> tuple[dict[str, Any], dict[str, Glm]]:
    """The linear members fitted on `data.train`, each penalty not set in `cfg` chosen on `data.val`; with
    every penalty set, started from `start` (the fits and the preprocessor of their inputs: the selection's,
    for the refit). Returns the report and the fits. Under torchrun each rank builds and fits its share of
    the rows (fusion_model/rank_sums.py): a table with fewer rows than ranks is fitted whole on every rank."""
    sums = rank_sums()
    if min(len(data.train), len(data.val)) < sums.size:
        sums = RankSums()

    def own(df: pd.DataFrame) -> pd.DataFrame:
        return df.iloc[sums.share(len(df))]

    def batch(df: pd.DataFrame, in_train: bool) -> dict[str, torch.Tensor]:
        ids, counts = pre.text(df)
        return {"text_ids": ids, "text_counts": counts, "categorical": pre.categorical(df),
                "numeric": pre.numeric(df, in_train=in_train)}

    scale: dict[str, Any] = {}
    if model.problem_type == "regression":
        scale = {"target_mean": float(model.target_mean), "target_std": float(model.target_std),
                 "target_transform": model.target_transform}
    l2, classes_l2 = cfg.linear_l2.model_dump(), cfg.linear_classes_l2.model_dump()
    if not pre.pair_trees:
        del l2["pairs"], classes_l2["pairs"]  # no such block: nothing to choose
    # started from a fit (the refit), the penalties are those it chose: a block the table lacks stays null
    choose = start is None and (any(v is None for v in l2.values()) or (
        model.linear_classes is not None and any(v is None for v in classes_l2.values())))
    started = time.perf_counter()
    report, fits = fit_linear(model, batch(own(data.train), True), torch.as_tensor(labels[sums.share(len(labels))]),
                              l2=l2, loss_kwargs=scale, val_batch=batch(own(data.val), False) if choose else None,
                              val_labels=torch.as_tensor(data.labels(own(data.val))) if choose else None,
                              start={m: carried_over(g, start[0], pre, model) for m, g in start[1].items()}
                              if start else None,
                              sums=sums, pair_codes=pre.pair_columns, gram_ratios=cfg.gram_ratios, classes_l2=classes_l2)
    report["fit_wall_s"] = round(time.perf_counter() - started, 2)
    report["rows"] = len(data.train)
    if int(os.environ.get("RANK", "0")) == 0:
        classes = f", multinomial L2 {report['classes']['l2']}" if "classes" in report else ""
        print(f"[train] linear member: L2 {report['l2']}{classes}{' (chosen on validation)' if choose else ''}, "
              f"{len(data.train)} rows, fitted in {report['fit_wall_s']} s", flush=True)
    return report, fits


def refit_linear_member(module: Any, pre: Preprocessor, data: ValidatedData, cfg: TrainConfig) -> None:
    """Refit "linear": the selection's linear members fitted again on train + val with the penalties
    validation chose, on the selection's inputs (`pre`: the kept deep members read them). Validation keeps
    weighing the training rows' fits; every checkpoint holds these (`FusionModule.keep_linear_fit`)."""
    validated = module.model.linear_fit_state()
    every = data.every_labelled()
    module.linear_report["refit"] = fit_linear_member(module.model, pre, every, every.labels(every.train),
                                                      cfg.with_linear_l2(module.linear_report),
                                                      (pre, module.linear_glm))[0]
    module.keep_linear_fit(validated, module.model.linear_fit_state())
