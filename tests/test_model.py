"""FusionModel, preprocessing and predictor: in-process, tiny timm test models at 32 px."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from fusion_model.data import DataError, FusionDataset, ValidatedData
from fusion_model.dataset import integer_codes, resolve_schema
from fusion_model.image_encoder import ImageEncoder
from fusion_model.model import FusionModel
from fusion_model.predict import PredictError, Predictor, build_model, read_rows_csv
from fusion_model.preprocess import PreprocessError, Preprocessor
from tests.validated_tables import make_validated

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def validated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_validated(tmp_path_factory.mktemp("model_data"), n_train=48, n_val=16, n_test=16)


@pytest.fixture(scope="module")
def pre(validated: Path) -> Preprocessor:
    data = ValidatedData.read(validated)
    return Preprocessor.fit(data.train, data.schema, text_buckets=256, image_size=32, image_index=0)


def _kwargs(pre: Preprocessor, image_model: str = "test_resnet") -> dict:
    return {
        "image_model": image_model, "image_size": 32, "cat_cardinalities": pre.cardinalities,
        "n_numeric": pre.n_numeric, "num_classes": 2, "text_buckets": 256, "text_vocab_size": pre.text_vocab_size,
        "cat_dim": 4, "adapter_dim": 16, "hidden_sizes": [32], "dropout": 0.0,
    }


def _batch(validated: Path, pre: Preprocessor, n: int = 8) -> dict[str, torch.Tensor]:
    data = ValidatedData.read(validated)
    ds = FusionDataset(data.train.iloc[:n], pre, data.dataset_root, labels=data.labels(data.train.iloc[:n]))
    return {k: torch.stack([ds[i][k] for i in range(n)]) for k in ds[0]}


def test_preprocessor_uses_train_statistics_and_round_trips(validated: Path, pre: Preprocessor) -> None:
    train = ValidatedData.read(validated).train
    assert pre.numeric_mean[pre.numeric_columns.index("Age")] == pytest.approx(np.log1p(train["Age"]).mean())
    again = Preprocessor.from_dict(json.loads(json.dumps(pre.to_dict())))
    assert again == pre
    unseen = train.iloc[:1].copy()
    unseen["Breed1"] = "999"  # never seen in train -> the unknown index 0
    assert pre.categorical(unseen)[0, pre.categorical_columns.index("Breed1")] == 0
    row = unseen.assign(Name="", Description="Friendly friendly")
    ids, counts = pre.text(row)
    assert sorted(counts[0][counts[0] > 0].tolist()) == [1.0, 2.0]  # "friendly" twice, "friendly friendly" once
    assert torch.equal(pre.text(row.assign(Description="FRIENDLY  friendly!"))[0], ids)  # stable, case-free


def test_frequencies_leave_a_training_row_out_and_bins_are_fractions(validated: Path, pre: Preprocessor) -> None:
    train = ValidatedData.read(validated).train
    seen = train.iloc[:3]
    as_train = pre.numeric(seen, in_train=True)
    as_new = pre.numeric(seen)
    assert as_train.shape == (3, pre.n_numeric)
    j = pre.numeric_columns.index("Breed1 frequency")
    counts = [pre.frequency_counts["Breed1"][b] for b in seen["Breed1"]]
    z = lambda c: (np.log1p(c) - pre.numeric_mean[j]) / pre.numeric_std[j]  # noqa: E731
    np.testing.assert_allclose(as_new[:, j].numpy(), [z(c) for c in counts], rtol=1e-5)
    np.testing.assert_allclose(as_train[:, j].numpy(), [z(c - 1) for c in counts], rtol=1e-5)  # itself left out
    bins = as_new[:, len(pre.numeric_columns):]
    assert bins.min() >= 0 and bins.max() <= 1
    assert pre.text_tables is not None and pre.text_vocab_size == int(pre.text_tables["rows"].max()) + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_backward_with_half_weights_and_fp32_inputs(validated: Path, pre: Preprocessor,
                                                            dtype: torch.dtype) -> None:
    model = FusionModel(**_kwargs(pre)).to(dtype)
    batch = _batch(validated, pre)
    assert batch["image"].dtype == torch.float32 and batch["numeric"].dtype == torch.float32
    logits = model(batch)
    assert logits.dtype == dtype and logits.shape == (8, 2)
    loss = model.loss(logits, batch["label"])
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == dtype for g in grads)
    assert torch.isfinite(loss)


def test_masking_a_modality_changes_the_output_and_rejects_unknown_names(validated: Path,
                                                                         pre: Preprocessor) -> None:
    torch.manual_seed(0)
    model = FusionModel(**_kwargs(pre)).eval()
    model.text.load_tables(**pre.text_tables)
    for wide in (model.text.bag.weight, *(t.weight for t in model.category_logit.tables)):
        torch.nn.init.normal_(wide)  # the wide logits start at zero: give them something to mask
    batch = _batch(validated, pre)
    full = model(batch)
    for name in ("image", "tabular", "text"):
        assert not torch.allclose(model(batch, mask={name}), full)
    with pytest.raises(ValueError, match="cannot mask \\['audio'\\]"):
        model(batch, mask={"audio"})


def test_tiny_batch_overfits(validated: Path, pre: Preprocessor) -> None:
    torch.manual_seed(0)
    model = FusionModel(**_kwargs(pre))
    model.text.load_tables(**pre.text_tables)
    batch = _batch(validated, pre, n=8)
    batch["label"] = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])  # labels the features do not explain
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):
        opt.zero_grad()
        loss = model.loss(model(batch), batch["label"])
        loss.backward()
        opt.step()
    model.eval()
    assert loss.item() < 0.05
    assert (model(batch).argmax(1) == batch["label"]).all()


def test_image_width_comes_from_a_forward_not_num_features() -> None:
    # test_mambaout pools to head_hidden_size (256), not num_features (64): the mobilenetv3 pitfall
    enc = ImageEncoder("test_mambaout", image_size=32)
    assert enc.backbone.num_features != enc.out_dim == 256


def test_pretrained_local_file_loads_strictly_and_hub_or_missing_file_are_refused(tmp_path: Path) -> None:
    import timm

    source = timm.create_model("test_resnet", pretrained=False)  # with its classifier, as weights are shared
    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))
    enc = ImageEncoder("test_resnet", pretrained=str(weights), image_size=32)
    for k, v in enc.backbone.state_dict().items():
        assert torch.equal(source.state_dict()[k], v)
    torch.save(source.state_dict(), tmp_path / "w.pt")  # a torch state dict, read with weights_only
    assert ImageEncoder("test_resnet", pretrained=str(tmp_path / "w.pt"), image_size=32)
    # another model's weights: refused, naming the keys
    other = timm.create_model("test_efficientnet", pretrained=False)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"does not match train.image_model .*missing keys: .*unexpected keys: "):
        ImageEncoder("test_resnet", pretrained=str(tmp_path / "other.safetensors"))
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    first = next(iter(enc.backbone.state_dict()))
    state[first] = torch.zeros(1, 3, 3, 3)
    save_file(state, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=rf"shape mismatches: {first} \(1, 3, 3, 3\) \(the model has"):
        ImageEncoder("test_resnet", pretrained=str(tmp_path / "shape.safetensors"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read as a state dict"):
        ImageEncoder("test_resnet", pretrained=str(tmp_path / "junk.pt"))
    with pytest.raises(ValueError, match="pass the path of a local weights file"):
        ImageEncoder("test_resnet", pretrained=True)
    with pytest.raises(ValueError, match="does not exist"):
        ImageEncoder("test_resnet", pretrained=str(tmp_path / "nope.pt"))
    with pytest.raises(ValueError, match="not a timm model.*timm.list_models"):
        ImageEncoder("no_such_model_xyz")


def test_image_index_picks_the_configured_image(validated: Path, pre: Preprocessor) -> None:
    data = ValidatedData.read(validated)
    second = Preprocessor.from_dict({**pre.to_dict(), "image_index": 1})
    late = Preprocessor.from_dict({**pre.to_dict(), "image_index": 9})  # past the end: the last image
    row = data.train.iloc[:1]
    assert FusionDataset(row, pre, data.dataset_root).paths[0].name.endswith("-1.jpg")
    assert FusionDataset(row, second, data.dataset_root).paths[0].name.endswith("-2.jpg")
    assert FusionDataset(row, late, data.dataset_root).paths[0].name.endswith("-2.jpg")


def test_missing_and_broken_images_name_the_row(validated: Path, pre: Preprocessor, tmp_path: Path) -> None:
    data = ValidatedData.read(validated)
    rows = data.train.iloc[:2].copy()
    rows.loc[rows.index[0], "Images"] = "images/missing.jpg"
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "broken.jpg").write_bytes(b"not a jpeg")
    ds = FusionDataset(rows, pre, data.dataset_root)
    with pytest.raises(PreprocessError, match=f"row {rows.index[0]}: image .*missing.jpg does not exist"):
        ds[0]
    rows.loc[rows.index[1], "Images"] = "images/broken.jpg"
    with pytest.raises(PreprocessError, match=f"row {rows.index[1]}: image .*broken.jpg cannot be decoded"):
        FusionDataset(rows, pre, tmp_path)[1]


def test_a_row_without_photos_gets_a_blank_masked_image(validated: Path, pre: Preprocessor) -> None:
    data = ValidatedData.read(validated)
    rows = data.train.iloc[:4].copy()
    rows.loc[rows.index[[1, 3]], "Images"] = ""
    ds = FusionDataset(rows, pre, data.dataset_root)
    assert ds.image_mask.tolist() == [1.0, 0.0, 1.0, 0.0] and ds.rows_with_images == 2
    assert ds[1]["image_mask"] == 0 and ds[1]["image"].abs().max() < 0.02  # the mean colour: ~0 normalised
    torch.manual_seed(0)
    model = FusionModel(**_kwargs(pre)).eval()
    batch = {k: torch.stack([ds[i][k] for i in range(4)]) for k in ds[0] if k != "label"}
    with torch.no_grad():
        full = model(batch)
        # a masked row's photo has no say: any image gives the same logits; a row with a photo does change
        batch["image"][1] = batch["image"][0]
        batch["image"][0] = -batch["image"][0]
        changed = model(batch)
    assert torch.equal(full[1], changed[1]) and not torch.equal(full[0], changed[0])


def test_a_model_without_the_image_modality_has_no_backbone(pre: Preprocessor, validated: Path) -> None:
    model = FusionModel(**_kwargs(pre), modalities=["tabular", "text"])
    assert not any(k.startswith("image.") for k in model.state_dict())
    batch = _batch(validated, pre, n=4)
    del batch["image"], batch["image_mask"]  # nothing of the image is needed
    assert model(batch, mask=("image",)).shape == (4, 2)


def test_validated_folder_errors_say_what_to_run(tmp_path: Path, validated: Path) -> None:
    with pytest.raises(DataError, match="meta.json is missing; run `python -m tasks validate`"):
        ValidatedData.read(tmp_path)
    bad = tmp_path / "v"
    bad.mkdir()
    for name in ("train.parquet", "val.parquet"):
        (bad / name).write_bytes((validated / name).read_bytes())
    meta = json.loads((validated / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "dataset_root": "nowhere"}))
    with pytest.raises(DataError, match="dataset_root 'nowhere' resolves to .* not a folder"):
        ValidatedData.read(bad)
    (bad / "meta.json").write_text(json.dumps({**meta, "dataset_root": str(validated / meta["dataset_root"]),
                                               "classes": [0]}))
    with pytest.raises(DataError, match=r"labels \['1'\] are not in meta.json classes \[0\]"):
        ValidatedData.read(bad)


def _saved_model(tmp_path: Path, pre: Preprocessor) -> tuple[Path, FusionModel]:
    config = {"format_version": 2, "model": _kwargs(pre), "preprocess": pre.to_dict(), "problem_type": "binary",
              "classes": [0, 1], "metric": "roc_auc", "label": "AdoptionSpeed",
              "dataset": resolve_schema({"preset": "petfinder"}).model_dump(mode="json")}
    model = build_model(config)
    (tmp_path / "model_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    return tmp_path, model


def test_predictor_round_trip_batches_and_ablation(validated: Path, pre: Preprocessor, tmp_path: Path) -> None:
    model_dir, model = _saved_model(tmp_path, pre)
    predictor = Predictor.load(model_dir)
    data = ValidatedData.read(validated)
    rows = data.val.drop(columns=["AdoptionSpeed"])
    proba = predictor.predict_proba(rows, data.dataset_root, batch_size=5)
    assert proba.shape == (len(rows), 2)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-5)
    with torch.inference_mode():
        ds = FusionDataset(rows, pre, data.dataset_root)
        direct = model.eval()({k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ds[0]}).softmax(-1)
    np.testing.assert_allclose(proba, direct.numpy(), rtol=1e-4, atol=1e-6)
    assert not np.allclose(predictor.predict_proba(rows, data.dataset_root, drop_modalities={"image"}), proba)
    preds = predictor.predict(rows, data.dataset_root)
    assert list(preds.columns) == ["PetID", "prediction", "proba_0", "proba_1"] and list(preds.index) == list(rows.index)
    assert (preds["PetID"] == rows["PetID"]).all()  # the row key comes back with its prediction
    with pytest.raises(PredictError, match="cannot drop \\['sound'\\]"):
        predictor.predict_proba(rows, data.dataset_root, drop_modalities={"sound"})


def test_predictor_refuses_missing_or_mismatched_files(validated: Path, pre: Preprocessor, tmp_path: Path) -> None:
    with pytest.raises(PredictError, match="model_config.json is missing; point --model at"):
        Predictor.load(tmp_path)
    model_dir, _ = _saved_model(tmp_path, pre)
    save_file({"head.weight": torch.zeros(2, 2)}, str(model_dir / "model.safetensors"))
    with pytest.raises(PredictError, match="does not match .*model_config.json.*convert the checkpoint again"):
        Predictor.load(model_dir)


def test_predict_cli_writes_a_csv(validated: Path, pre: Preprocessor, tmp_path: Path) -> None:
    from fusion_model.predict import main

    (tmp_path / "m").mkdir()
    model_dir, _ = _saved_model(tmp_path / "m", pre)
    data = ValidatedData.read(validated)
    csv = tmp_path / "new.csv"
    rows = pd.read_parquet(validated / "test.parquet").drop(columns=["AdoptionSpeed", "row_id"])
    rows.to_csv(csv)  # with the tutorial's leading unnamed index column
    assert list(read_rows_csv(csv, ["Name", "Description"]).index) == list(rows.index)
    out = tmp_path / "preds.csv"
    assert main(["--model", str(model_dir), "--csv", str(csv), "--images-root", str(data.dataset_root),
                 "--out", str(out)]) == 0
    preds = pd.read_csv(out)
    assert len(preds) == len(rows) and {"prediction", "proba_0", "proba_1"} <= set(preds.columns)


def _fit(data: ValidatedData, pre: Preprocessor, kwargs: dict, epochs: int = 2, **module_args: object):
    import lightning.pytorch as pl

    from fusion_model.data import FusionDataModule
    from fusion_model.module import FusionModule

    module = FusionModule(kwargs, lr=1e-2, weight_decay=0.0, **module_args)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=FusionDataModule(data, pre, batch_size=8))
    return module, trainer


def test_ordinal_labels_train_a_cumulative_link_head_with_fitted_cut_points(tmp_path: Path) -> None:
    """Kaggle's 0-4 labels as ordinal: one score through increasing thresholds, val/qwk monitored, and cut
    points fitted on the validation rows kept in the model."""
    data = ValidatedData.read(make_validated(tmp_path, n_train=60, n_val=30, n_test=5, problem_type="ordinal"))
    pre = Preprocessor.fit(data.train, data.schema, text_buckets=256, image_size=32, image_index=0)
    kwargs = {**_kwargs(pre), "num_classes": 5, "problem_type": "ordinal"}
    module, trainer = _fit(data, pre, kwargs, epochs=3)
    assert data.classes == [0, 1, 2, 3, 4] and data.problem_type == "ordinal"
    link = module.model.ordinal
    assert (link.thresholds().diff() > 0).all()  # the order holds whatever training did
    assert not torch.equal(link.cutpoints, torch.arange(4.0) + 0.5)  # fitted, not the rounding it starts from
    qwk = float(trainer.callback_metrics["val/qwk"])
    assert 0.3 < qwk <= 1.0 and {"val/accuracy", "val/mae"} <= set(trainer.callback_metrics)
    batch = _batch(data_dir := tmp_path / "validated", pre)
    assert data_dir.is_dir()
    out = module.model.eval().interpret(module.model(batch))
    assert out.proba.shape == (8, 5) and torch.allclose(out.proba.sum(1), torch.ones(8))
    assert out.prediction.min() >= 0 and out.prediction.max() <= 4


def test_regression_head_predicts_in_the_label_unit(tmp_path: Path) -> None:
    data = ValidatedData.read(make_validated(tmp_path, n_train=60, n_val=30, n_test=5))
    schema = resolve_schema({"preset": "petfinder", "columns": {"numerical": ["Quantity", "VideoAmt", "PhotoAmt"]},
                             "label": {"column": "Age", "problem_type": "regression", "transform": "log1p"}})
    data = ValidatedData(data.train, data.val, data.dataset_root, schema, "regression", [])
    pre = Preprocessor.fit(data.train, schema, text_buckets=256, image_size=32, image_index=0)
    kwargs = {**_kwargs(pre), "num_classes": 1, "problem_type": "regression", "target_transform": "log1p"}
    model = FusionModel(**kwargs)
    target = np.log1p(data.train["Age"].to_numpy())
    model.target_mean.fill_(float(target.mean()))
    model.target_std.fill_(float(target.std()))
    batch = _batch(tmp_path / "validated", pre)
    with torch.no_grad():
        zero = torch.zeros(8, 1)  # the standardised mean: the training rows' mean of log1p(Age)
        assert torch.allclose(model.interpret(zero).prediction, torch.full((8,), float(np.expm1(target.mean()))))
        loss = model.loss(model(batch), torch.from_numpy(data.labels(data.train.iloc[:8])))
    assert torch.isfinite(loss)
    module, trainer = _fit(data, pre, {**kwargs}, epochs=2)
    assert {"val/rmse", "val/mae", "val/r2"} <= set(trainer.callback_metrics)


def test_multiclass_predicts_with_class_biases_fitted_on_the_validation_rows_probabilities(tmp_path: Path) -> None:
    """The multiclass rule: each validation fits class biases to the macro F1 that the validation rows' own
    probabilities expect (no labels read), keeps them in the model's buffer, and predictions are the argmax of
    the log probabilities plus them; val/macro_f1 is scored with that rule."""
    from sklearn.metrics import f1_score

    from fusion_model.data import FusionDataModule
    from fusion_model.decision import apply_class_bias, fit_class_bias

    data = ValidatedData.read(make_validated(tmp_path, n_train=60, n_val=30, n_test=5, problem_type="multiclass"))
    data = ValidatedData(data.train, data.val, data.dataset_root, data.schema, "multiclass", data.classes)
    pre = Preprocessor.fit(data.train, data.schema, text_buckets=256, image_size=32, image_index=0)
    kwargs = {**_kwargs(pre), "num_classes": 5, "problem_type": "multiclass"}
    module, trainer = _fit(data, pre, kwargs, class_weight=[1.0, 2.0, 1.0, 1.0, 1.0])
    assert {"val/macro_f1", "val/accuracy", "val/log_loss"} <= set(trainer.callback_metrics)
    module.model.eval()
    loader = FusionDataModule(data, pre, batch_size=8)
    loader.setup("fit")
    with torch.no_grad():
        batches = list(loader.val_dataloader())
        raw = torch.cat([module.model(b) for b in batches])
        out = module.model.interpret(raw)
    labels = torch.cat([b["label"] for b in batches]).numpy()
    proba = out.proba.numpy()
    bias = fit_class_bias(proba)
    assert np.allclose(module.model.decision_bias.numpy(), bias)  # the last validation's, from its probabilities
    assert np.array_equal(out.prediction.numpy(), apply_class_bias(proba, bias))
    assert np.isclose(float(trainer.callback_metrics["val/macro_f1"]),
                      f1_score(labels, apply_class_bias(proba, bias), average="macro", labels=range(5)), atol=1e-6)
    module.model.decision_bias.copy_(torch.tensor([0.0, 3.0, 0.0, 0.0, 0.0]))  # a bias the argmax would not make
    with torch.no_grad():
        shifted = module.model.interpret(raw).prediction
    assert np.array_equal(shifted.numpy(), apply_class_bias(proba, np.array([0.0, 3.0, 0.0, 0.0, 0.0])))
    assert (shifted == 1).sum() > (out.prediction == 1).sum()


def test_a_single_modality_model_has_no_empty_optimizer_group(validated: Path, pre: Preprocessor) -> None:
    """ZeRO drops an empty parameter group, which left the scheduler one group longer than the optimizer
    (a text-only baseline has nothing that decays)."""
    import lightning.pytorch as pl

    from fusion_model.data import FusionDataModule
    from fusion_model.module import FusionModule

    module = FusionModule({**_kwargs(pre), "modalities": ["text"]}, lr=1e-2, weight_decay=0.1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=FusionDataModule(ValidatedData.read(validated), pre, batch_size=8))
    groups = trainer.optimizers[0].param_groups
    assert groups and all(g["params"] for g in groups)
    assert len(trainer.lr_scheduler_configs[0].scheduler.base_lrs) == len(groups)


def test_auxiliary_heads_add_a_loss_per_deep_modality_and_are_not_used_to_predict(validated: Path,
                                                                                 pre: Preprocessor) -> None:
    torch.manual_seed(0)
    model = FusionModel(**_kwargs(pre), aux_loss_weight=0.5)
    assert set(model.aux_heads) == {"image", "tabular"}
    batch = _batch(validated, pre)
    model.train()
    with_aux = model.loss(model(batch), batch["label"])
    model.aux_loss_weight = 0.0
    without = model.loss(model(batch), batch["label"])
    assert with_aux > without  # the heads' own losses are added in training
    model.eval()
    raw = model(batch)
    assert model._aux == [] and torch.equal(raw, model(batch))  # predicting ignores them


def test_a_numerical_column_with_few_values_is_also_a_code(validated: Path) -> None:
    data = ValidatedData.read(validated)
    pre = Preprocessor.fit(data.train, data.schema, text_buckets=256, image_size=32, image_index=0,
                           numeric_codes_max=5)
    coded = [c for c in pre.categorical_columns if c in data.schema.columns.numerical]
    assert "Quantity" not in coded  # one value in every row: nothing to code
    assert coded and all(data.train[c].nunique() <= 5 for c in coded)
    assert all(c in pre.numeric_columns for c in coded)  # still a number too
    codes = pre.categorical(data.train.iloc[:3])
    assert codes.shape == (3, len(pre.categorical_columns)) and (codes[:, -1] > 0).all()


def test_integer_codes_are_codes_of_whole_numbers_of_more_than_two_values() -> None:
    table = pd.DataFrame({"item": ["15970", "7", "", "301"], "flag": ["1", "2", "1", "2"],
                          "colour": ["Red", "Blue", "Red", "Navy"], "size": ["1", "2", "3", "3.5"]})
    assert integer_codes(table, ["item", "flag", "colour", "size", "absent"]) == ["item"]


def test_a_code_of_whole_numbers_also_enters_as_a_number_in_its_order(validated: Path) -> None:
    data = ValidatedData.read(validated)
    numbered = integer_codes(data.train, list(data.schema.columns.categorical))
    assert numbered  # the PetFinder-shaped table's breed and colour numbers
    fit = {"text_buckets": 256, "image_size": 32, "image_index": 0}
    off = Preprocessor.fit(data.train, data.schema, **fit)
    pre = Preprocessor.fit(data.train, data.schema, codes_as_numbers=True, **fit)
    assert not set(numbered) & set(off.numeric_columns)
    assert pre.categorical_columns == off.categorical_columns  # still a code too
    rows = data.val.iloc[:20]
    for column in numbered:
        z = pre._standardised(rows, in_train=False)[:, pre.numeric_columns.index(column)]
        order = np.argsort(pd.to_numeric(rows[column]).to_numpy(), kind="stable")
        assert np.all(np.diff(z[order]) >= 0)  # the bigger number, the bigger input


def test_a_model_of_the_earlier_format_still_loads_and_predicts(validated: Path, pre: Preprocessor,
                                                               tmp_path: Path) -> None:
    """A champion promoted before dataset schemas (model_config.json format 1) keeps working."""
    from fusion_model.legacy import upgrade_config

    model_dir, model = _saved_model(tmp_path, pre)
    config = json.loads((model_dir / "model_config.json").read_text())
    numeric = [c.replace("RescuerID frequency", "rescuer_listings").replace("Breed1 frequency", "breed1_frequency")
               for c in pre.numeric_columns]
    v1_pre = {k: v for k, v in pre.to_dict().items() if k not in ("numeric_log", "frequency_columns",
                                                                 "frequency_counts", "image_columns")}
    v1_pre.update(numeric_columns=numeric, rescuer_counts=pre.frequency_counts["RescuerID"],
                  breed1_counts=pre.frequency_counts["Breed1"],
                  vocabularies={c: [int(v) for v in vs] for c, vs in pre.vocabularies.items()})
    v1_model = {k: v for k, v in config["model"].items() if k not in ("problem_type", "target_transform")}
    v1 = {"format_version": 1, "model": v1_model, "preprocess": v1_pre, "label": "AdoptionSpeed",
          "label_kind": "binary", "classes": [0, 1], "metric": "auc"}
    upgraded = upgrade_config(v1)
    assert upgraded["problem_type"] == "binary" and upgraded["dataset"]["preset"] == "petfinder"
    assert Preprocessor.from_dict(upgraded["preprocess"]) == pre
    (model_dir / "model_config.json").write_text(json.dumps(v1))
    data = ValidatedData.read(validated)
    rows = data.val.drop(columns=["AdoptionSpeed"])
    old = Predictor.load(model_dir).predict_proba(rows, data.dataset_root)
    (model_dir / "model_config.json").write_text(json.dumps(config))
    np.testing.assert_allclose(old, Predictor.load(model_dir).predict_proba(rows, data.dataset_root), rtol=1e-6)
    with pytest.raises(ValueError, match="format_version 9 is newer than this version reads"):
        upgrade_config({**v1, "format_version": 9})


def test_each_member_penalises_its_own_wide_text_columns_as_logistic_regression_does(validated: Path,
                                                                                     pre: Preprocessor) -> None:
    """A member's text_l2 is a coupled L2 penalty (in the loss, per training row as logistic regression's
    1 / (2 C)) on that member's columns of the text table only; the body keeps its AdamW decay."""
    import lightning.pytorch as pl

    from fusion_model.data import FusionDataModule
    from fusion_model.module import FusionModule

    torch.manual_seed(0)
    kwargs = {**_kwargs(pre), "modalities": ["text", "tabular"], "fusion": "tabm", "ensemble_size": 4,
              "member_text_scale": [1.0, 1.0], "member_category_scale": [1.0, 1.0]}
    module = FusionModule(kwargs, lr=5e-2, weight_decay=0.01, text_l2=[0.0, 20.0], category_l2=[0.0, 0.0],
                          train_rows=48)
    module.model.text.load_tables(**pre.text_tables)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=FusionDataModule(ValidatedData.read(validated), pre, batch_size=8))
    weight = module.model.text.bag.weight  # [n-grams, members * width], member-major
    width = module.model.width
    free, penalised = float(weight[:, :width].norm()), float(weight[:, width:].norm())
    assert 0 < penalised < 0.5 * free
    groups = trainer.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and all(g["decoupled_weight_decay"] for g in groups)
    assert any(p is module.model.text.bag.weight for p in groups[1]["params"])  # no decay on top of the L2


def test_greedy_selection_gives_a_lone_best_member_every_pick_and_mixes_complementary_ones() -> None:
    from fusion_model.ensemble import greedy_weights

    assert greedy_weights(3, lambda w: float((w - torch.tensor([0.0, 1.0, 0.0])).abs().sum())).tolist() == [0, 1, 0]
    # two members each right on half the rows: their even mix is best
    mixed = greedy_weights(2, lambda w: float((w[0] - 0.5) ** 2 + (w[1] - 0.5) ** 2), rounds=10)
    assert mixed.tolist() == [0.5, 0.5]


def test_a_tabm_network_mixes_its_members_heads_into_one_prediction(validated: Path, pre: Preprocessor) -> None:
    """fusion tabm: k heads over one body, split among the members; the prediction is the members'
    probabilities mixed by member_weights, each member the mean of its heads."""
    torch.manual_seed(0)
    model = FusionModel(**{**_kwargs(pre), "fusion": "tabm", "ensemble_size": 4,
                           "member_text_scale": [1.0, 15.0], "member_category_scale": [1.0, 5.0]}).eval()
    batch = _batch(validated, pre)
    heads_raw = model.head_outputs(batch)
    assert heads_raw.shape == (8, 4, 2) and model.head_member.tolist() == [0, 1, 0, 1]
    model.member_weights.copy_(torch.tensor([0.0, 1.0]))
    second = torch.softmax(heads_raw[:, [1, 3]], -1).mean(1)
    torch.testing.assert_close(torch.softmax(model(batch), -1), second)
    assert "member_weights" in model.state_dict() and "head_member" not in model.state_dict()


def test_a_member_with_zero_multipliers_reads_the_body_alone(validated: Path, pre: Preprocessor) -> None:
    """train.members' second default entry: its heads add no word or code logits, whatever the tables hold;
    the first member's heads do."""
    from pydantic import ValidationError

    from fusion_model.config import TrainConfig, WideMember

    second = TrainConfig().members[1]
    assert (second.text_lr_multiplier, second.category_lr_multiplier) == (0, 0)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        WideMember(text_lr_multiplier=-1)
    torch.manual_seed(0)
    model = FusionModel(**{**_kwargs(pre), "fusion": "tabm", "ensemble_size": 4,
                           "member_text_scale": [1.5, 0.0], "member_category_scale": [1.0, 0.0]}).eval()
    model.text.load_tables(**pre.text_tables)
    batch = _batch(validated, pre)
    tables = [model.text.bag.weight, *(t.weight for t in model.category_logit.tables)]
    with torch.no_grad():
        before = model.head_outputs(batch)
        for weight in tables:
            weight.normal_()
        after = model.head_outputs(batch)
    assert model.head_member.tolist() == [0, 1, 0, 1]
    torch.testing.assert_close(after[:, [1, 3]], before[:, [1, 3]], rtol=0, atol=0)
    assert not torch.allclose(after[:, [0, 2]], before[:, [0, 2]])


def test_a_wide_key_of_the_earlier_layout_is_refused_with_where_it_moved() -> None:
    from pydantic import ValidationError

    from fusion_model.config import TrainConfig

    with pytest.raises(ValidationError, match=r"train.text_l2, train.text_lr_multiplier moved into train.members"):
        TrainConfig(text_l2=1.0, text_lr_multiplier=15)
    with pytest.raises(ValidationError, match="members but fusion mlp has one head"):
        TrainConfig(fusion="mlp")
    assert TrainConfig(fusion="mlp", members=[{"text_l2": 1.0}]).members[0].text_l2 == 1.0


def test_bins_follow_the_labels_and_fit_a_table_smaller_than_the_bin_count() -> None:
    from fusion_model.preprocess import _bin_edges

    z = np.linspace(-1, 1, 200)
    labels = (z > 0.3).astype(np.int64)  # one informative cut
    edges = _bin_edges(z, 64, labels, ordered=False, min_rows=8)
    assert edges[0] == pytest.approx(-1) and edges[-1] == pytest.approx(1)
    assert any(abs(e - 0.3) < 0.02 for e in edges) and len(edges) < 10  # the tree's cut, few bins
    tiny = _bin_edges(z[:32], 64, labels[:32], ordered=False, min_rows=8)  # 32 rows, 64 bins asked
    assert len(tiny) >= 2 and tiny == sorted(tiny)
    assert _bin_edges(np.zeros(5), 64, None, ordered=False, min_rows=8) == [-1.0, 1.0]  # one value: one bin


def test_the_text_logit_sums_only_the_grams_it_weighs_and_gives_their_gradients() -> None:
    """The bag is given the entries of non-zero weight alone (no padding, no character grams): the same sums
    and gradients as weighing every entry of the padded batch."""
    from fusion_model.wide import TextLogit

    torch.manual_seed(0)
    text = TextLogit(buckets=64, vocab_size=12, num_classes=3, max_order=2, chars=True)
    text.load_tables(rows=np.arange(64) % 12, idf=np.linspace(0.5, 2.0, 12).astype(np.float32),
                     order=np.array([0, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2]))  # orders 1 (words) and 2 (characters)
    torch.nn.init.normal_(text.bag.weight)
    ids = torch.tensor([[3, 5, 7, 9, 0, 0], [0, 0, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0], [1, 2, 3, 4, 10, 11]])
    counts = (ids > 0).float() * torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 1.0])
    rows, weights = text.row_weights(ids, counts, chars=False)
    expected = (weights.unsqueeze(-1) * text.bag.weight[rows]).sum(1)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), text.bag.weight)
    got = text(ids, counts)
    (grad,) = torch.autograd.grad(got.square().sum(), text.bag.weight)
    assert torch.allclose(got, expected, atol=1e-6) and torch.allclose(grad, expected_grad, atol=1e-6)
    assert got[1].abs().sum() == 0 and got[2].abs().sum() == 0  # only padding / only character grams
    assert expected_grad[[5, 6, 7, 8, 11]].abs().sum() == 0 and grad.abs().sum() > 0
