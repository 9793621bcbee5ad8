"""The loss contract and the registries: one forward signature, defaults from constructors, one error."""

from __future__ import annotations

import inspect

import pytest
import timm.data
import torch

from engine.model.model_card import Preprocessing
from training.backbone import BACKBONES, create_backbone
from training.losses import LOSSES, BatchLayout, MetricLoss, build_loss, register_loss
from training.losses.registry import signature_defaults
from training.recipes import parse_assignments, resolve
from training.registry import Registry


def test_every_loss_keeps_one_forward_contract() -> None:
    for name, spec in LOSSES.items():
        loss = spec.build()
        assert isinstance(loss, MetricLoss), name
        parameters = list(inspect.signature(type(loss).forward).parameters.values())
        assert [p.name for p in parameters] == ["self", "embeddings", "labels", "batch_info"], name
        assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD, name
        assert loss.last_sample_losses is None, name  # declared by the base class, set by forward


def test_registry_defaults_are_the_constructor_defaults() -> None:
    for name, spec in LOSSES.items():
        constructor = {
            key: value.default
            for key, value in inspect.signature(spec.factory).parameters.items()
            if key not in spec.fixed
        }
        assert spec.defaults == constructor, name
    # the fixed arguments are constructor arguments too, and cannot be passed through build_loss
    assert set(LOSSES["npair"].fixed) <= set(inspect.signature(LOSSES["npair"].factory).parameters)


def test_a_loss_without_a_default_cannot_be_registered() -> None:
    class NeedsMargin(MetricLoss):
        def __init__(self, margin: float) -> None:
            super().__init__()

    with pytest.raises(TypeError, match="margin"):
        register_loss("needs-margin", NeedsMargin, layout=LOSSES["ms"].layout, paper="-", summary="-")
    assert "needs-margin" not in LOSSES
    assert signature_defaults(lambda a=1, *args, b=2, **kwargs: None, exclude={"b"}) == {"a": 1}


def test_an_unknown_name_fails_in_one_place_with_the_known_names() -> None:
    expected = f"unknown loss 'nope'; choose one of {sorted(LOSSES)}"
    lookups = (
        lambda: LOSSES["nope"],
        lambda: build_loss("nope"),
        lambda: parse_assignments("nope", []),
        lambda: resolve("nope"),
    )
    for lookup in lookups:
        with pytest.raises(ValueError) as raised:
            lookup()
        assert str(raised.value) == expected
    with pytest.raises(ValueError, match=r"unknown backbone 'nope'; choose one of \['efficientnet_lite0'\]"):
        create_backbone("nope", pretrained=False)
    assert "nope" not in LOSSES and LOSSES.get("nope") is None  # membership tests stay plain dict ones


def test_registering_a_name_twice_is_refused() -> None:
    table: Registry[int] = Registry("thing")
    table.add("a", 1)
    with pytest.raises(ValueError, match="thing 'a' registered twice"):
        table.add("a", 2)
    with pytest.raises(ValueError, match="registered twice"):
        register_loss(
            "ms",
            LOSSES["ms"].factory,
            layout=BatchLayout("classes_x_samples", 2, 2, "-"),
            paper="-",
            summary="-",
        )


def test_backbone_preprocessing_is_timms_data_config_and_what_models_were_exported_with() -> None:
    preprocessing = BACKBONES["efficientnet_lite0"].preprocessing
    timm_config = timm.data.resolve_model_data_config(create_backbone("efficientnet_lite0", pretrained=False))
    assert timm_config["input_size"] == (3, preprocessing.input_size, preprocessing.input_size)
    assert timm_config["interpolation"] == preprocessing.interpolation
    assert (timm_config["mean"], timm_config["std"]) == (preprocessing.mean, preprocessing.std)
    # the values every exported model card and feature cache so far was made with (no evaluation crop)
    assert preprocessing == Preprocessing(
        input_size=224, resize_size=224, interpolation="bicubic", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)
    )


def test_extra_batch_info_reaches_every_loss_and_is_ignored_where_unused() -> None:
    labels = torch.arange(4).repeat_interleave(2)
    x = torch.randn(8, 128, dtype=torch.float64)
    for name, spec in LOSSES.items():
        loss = spec.build().double()
        assert torch.isfinite(loss(x, labels, cluster_ids=labels, epoch=torch.tensor(3))), name
