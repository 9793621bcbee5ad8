"""How a run computes: bfloat16 detection, the precision setting (and turning it off), what config.json
records, chunked backbone passes whose gradient is the whole batch's, and float32 export of a bf16 run."""

from __future__ import annotations

import json
import platform
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from bench.lib.images import write_labelled_folder
from engine.decode.images import load_image_file
from engine.model.embedder import Embedder
from tests.support.train_config import tiny_train_config
from training import precision
from training.backbone import create_backbone
from training.config import TrainConfig
from training.data import load_labelled_images
from training.export import export_run
from training.heads import ResidualHead
from training.losses import build_loss
from training.model import EmbeddingModel, TrainingObjective, build_objective
from training.precision import cpu_has_native_bf16, resolve_compute
from training.run_dir import RunDirectory
from training.trainer import train

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="reads Linux x86 CPU flags"
)
def test_native_bf16_detection_agrees_with_the_kernels_cpu_flags() -> None:
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    native = bool({"avx512_bf16", "amx_bf16"} & set(flags.split(":", 1)[1].split()))
    assert cpu_has_native_bf16() == native


@pytest.mark.parametrize(
    ("setting", "native", "expected"),
    [
        ("auto", True, torch.bfloat16),
        ("auto", False, None),  # emulated bfloat16 is slower than float32: not used
        ("bf16", True, torch.bfloat16),
        ("fp32", True, None),  # the switch turns it off where it would be used
    ],
)
def test_cpu_precision_follows_the_setting_and_the_hardware(
    setting: str, native: bool, expected: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    compute = resolve_compute(setting, True, CPU)  # type: ignore[arg-type]
    assert compute.autocast == expected and compute.channels_last
    assert compute.record()["precision"] == {torch.bfloat16: "bf16", None: "fp32"}[expected]


@pytest.mark.parametrize(
    ("setting", "bf16", "expected"),
    [
        ("auto", True, torch.bfloat16),
        ("auto", False, torch.float16),  # older GPUs: float16, with a gradient scaler
        ("fp16", True, torch.float16),
        ("fp32", True, None),
    ],
)
def test_gpu_precision_takes_the_same_path(
    setting: str, bf16: bool, expected: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    assert resolve_compute(setting, False, CUDA).autocast == expected  # type: ignore[arg-type]


def test_emulated_bf16_is_used_only_when_asked_for_and_then_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="emulates bfloat16"):
        compute = resolve_compute("bf16", True, CPU)
    assert compute.autocast == torch.bfloat16 and "emulates" in compute.record()["reason"]
    with pytest.raises(ValueError, match="for GPUs"):
        resolve_compute("fp16", True, CPU)


def test_runs_saved_with_amp_load_as_a_precision() -> None:
    saved = {"loss": "ms", "data": "x", "amp": False}
    assert TrainConfig.model_validate(saved).precision == "fp32"
    assert TrainConfig.model_validate({**saved, "amp": True}).precision == "auto"


def _tiny_conv_objective(chunk: int) -> TrainingObjective:
    """Convolution + batch norm + dropout backbone, head and MS loss, in float64, same weights per call."""
    torch.manual_seed(0)
    backbone = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Dropout(0.3),  # random: the recomputed forward must draw the same mask
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    with torch.no_grad():  # statistics other than the identity, so frozen batch norm matters
        backbone[1].running_mean.uniform_(-0.5, 0.5)
        backbone[1].running_var.uniform_(0.5, 2.0)
    objective = TrainingObjective(backbone, ResidualHead(6, 4, 8), build_loss("ms"), chunk=chunk).double()
    with torch.no_grad():
        objective.head.residual[-1].weight.normal_(0, 0.1)  # non-zero: gradients reach the whole head
    return objective.train()


def test_chunked_backbone_passes_give_the_whole_batch_gradient() -> None:
    images = torch.randn(10, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(5).repeat_interleave(2)
    results = []
    for chunk in (0, 3):  # 3 does not divide 10: the last chunk is smaller
        objective = _tiny_conv_objective(chunk)
        calls: list[int] = []
        objective.backbone.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        torch.manual_seed(7)
        value = objective(images, labels)
        value.backward()
        grads = {name: p.grad.clone() for name, p in objective.named_parameters() if p.grad is not None}
        stats = {name: b.clone() for name, b in objective.named_buffers()}
        results.append((value.detach(), grads, stats, len(calls)))
    (whole, whole_grads, whole_stats, whole_calls), (chunked, chunked_grads, chunked_stats, chunked_calls) = (
        results
    )
    assert (whole_calls, chunked_calls) == (1, 8), "4 chunks, each run forward and again in the backward"
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    assert chunked_grads.keys() == whole_grads.keys() and any("backbone" in name for name in whole_grads)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    for name, buffer in whole_stats.items():  # frozen batch norm: statistics untouched by either pass
        torch.testing.assert_close(chunked_stats[name], buffer, rtol=0, atol=0)


def test_chunks_are_for_training_only() -> None:
    """Evaluation (no gradients) runs the batch in one pass: nothing to recompute."""
    objective = _tiny_conv_objective(3).eval()
    calls = []
    objective.backbone.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        objective.embed(torch.randn(10, 3, 8, 8, dtype=torch.float64))
    assert calls == [1]


def _finetune_config(data: Path, cache: Path, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "mode": "finetune",
        "max_steps": 2,
        "eval_every": 2,
        "embedding_dim": 8,
        "head_hidden": 16,
        "lr": 1e-3,
        "classes_per_batch": 2,
        "samples_per_class": 3,
        "backbone_chunk": 4,
        "workers": 0,
        "eval_batch_size": 8,
    }
    return tiny_train_config(data, cache, **{**settings, **overrides})


def _watch_first_convolution(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, bool]]:
    """(output dtype, channels-last input) of the backbone's first convolution in each training forward."""
    seen: list[tuple[torch.dtype, bool]] = []

    def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            seen.append((output.dtype, inputs[0].is_contiguous(memory_format=torch.channels_last)))

    def build(config: TrainConfig, feature_dim: int) -> TrainingObjective:
        objective = build_objective(config, feature_dim)
        next(m for m in objective.backbone.modules() if isinstance(m, nn.Conv2d)).register_forward_hook(hook)
        return objective

    monkeypatch.setattr("training.trainer.build_objective", build)
    return seen


@pytest.mark.slow  # a real fine-tuning run on the CPU
def test_a_bf16_finetune_run_records_it_and_exports_float32_matching_torch(
    feature_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 where the CPU has it (made to say so here; torch emulates it on any CPU): the steps run
    in channels-last bfloat16, config.json says so, and the export is float32 ONNX matching torch."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    seen = _watch_first_convolution(monkeypatch)
    data = write_labelled_folder(tmp_path / "images", classes=8, per_class=3, size=48)
    out = tmp_path / "run"
    train(_finetune_config(data, feature_cache), out, progress=False)
    assert seen and set(seen) == {(torch.bfloat16, True)}
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["precision"] == "auto"
    assert recorded["compute"] == {
        "device": "cpu",
        "precision": "bf16",
        "channels_last": True,
        "reason": "the CPU computes bfloat16 natively",
    }

    run = RunDirectory(out)  # export the bf16-trained weights, whichever step validation selected
    best = replace(run.require_best(), objective=run.load_last().objective)
    run.save_best(best)
    objective = build_objective(run.require_config(), 1280)
    objective.load_state_dict(best.objective)
    pretrained = create_backbone().state_dict()
    assert any(not torch.equal(v, pretrained[k]) for k, v in objective.backbone.state_dict().items())

    model_path = tmp_path / "model.onnx"
    export_run(out, model_path)
    embedder = Embedder(model_path)
    images = [load_image_file(path) for path in load_labelled_images(data).files()[:6]]
    exported = embedder.embed(images)
    assert exported.dtype == np.float32 and embedder.card.precision == "fp32"
    with torch.no_grad():
        expected = EmbeddingModel(objective.backbone, objective.head).eval()(
            torch.from_numpy(embedder.preprocess(images))
        )
    np.testing.assert_allclose(exported, expected.numpy(), atol=2e-4)


def test_precision_fp32_turns_bf16_off_and_config_json_says_so(
    feature_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    seen = _watch_first_convolution(monkeypatch)
    data = write_labelled_folder(tmp_path / "images", classes=8, per_class=3, size=48)
    config = _finetune_config(data, feature_cache, precision="fp32", channels_last=False, max_steps=1)
    train(config, tmp_path / "run", progress=False)
    assert seen and set(seen) == {(torch.float32, False)}
    compute = json.loads((tmp_path / "run" / "config.json").read_text())["compute"]
    assert (compute["precision"], compute["channels_last"]) == ("fp32", False)
