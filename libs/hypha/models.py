"""Building the model a DiLoCo job names, and writing it back out as a ``from_pretrained`` dir.

The trainers and the parameter server build the same model from the same
fetched files, so θ_global and every θ_local start identical and share
parameter names. Three kinds (``ModelSpec.type``):

- ``causal-lm`` and ``vision-classification``: Hugging Face Auto classes
  loaded from the fetched local directory (``config.json`` + weights), with
  the spec's ``config_overrides`` applied to the config first;
- ``torch``: a factory given by import path (``"pkg.mod:factory"``) called
  with the overrides as keyword arguments, only if the worker's allowlist
  names it (``hypha.factories``); a ``model.safetensors`` in the fetched
  directory, when there is one, supplies the weights.

The tiny configurations at the end are what tests, the demo and the
benchmarks train: small enough for a CPU, real enough to exercise the Auto
classes through ``save_pretrained``/``from_pretrained``.
"""

from __future__ import annotations

import filecmp
import importlib
import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hypha import factories
from hypha.errors import InvalidArgumentError, NotFoundError
from hypha.v1 import common_pb2

#: The file a ``torch`` model's weights live in, as ``save_pretrained`` names them.
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: Seed used before calling a ``torch`` factory, so every process builds the same initial weights.
FACTORY_SEED = 0

# NOTE: ``from_pretrained`` builds on the meta device through process-global state; two
# builds at once in one process (tests and benchmarks run several executors together,
# each from a thread) corrupt each other. One executor process builds one model, so a
# lock costs nothing in production.
_BUILD_LOCK = threading.Lock()


class ModelKind(StrEnum):
    CAUSAL_LM = "causal-lm"
    VISION_CLASSIFICATION = "vision-classification"
    TORCH = "torch"


_FROM_PROTO = {
    common_pb2.MODEL_TYPE_CAUSAL_LM: ModelKind.CAUSAL_LM,
    common_pb2.MODEL_TYPE_VISION_CLASSIFICATION: ModelKind.VISION_CLASSIFICATION,
    common_pb2.MODEL_TYPE_TORCH: ModelKind.TORCH,
}


def model_kind(spec: common_pb2.ModelSpec) -> ModelKind:
    """The spec's kind; an unspecified type means ``torch`` with a factory, else ``causal-lm``."""
    if spec.type == common_pb2.MODEL_TYPE_UNSPECIFIED:
        return ModelKind.TORCH if spec.torch_factory else ModelKind.CAUSAL_LM
    try:
        return _FROM_PROTO[spec.type]
    except KeyError:
        raise InvalidArgumentError(f"unknown model type {spec.type}") from None


def has_pretrained_weights(spec: common_pb2.ModelSpec, model_dir: Path | None) -> bool:
    """Whether the fetched files fix the initial weights (else a factory's seeded init does)."""
    if model_kind(spec) is not ModelKind.TORCH:
        return True
    return model_dir is not None and (model_dir / WEIGHTS_NAME).is_file()


def parse_overrides(overrides: Mapping[str, str]) -> dict[str, Any]:
    """Config overrides arrive as strings; JSON values (numbers, booleans, lists) are decoded."""
    parsed: dict[str, Any] = {}
    for key, text in overrides.items():
        try:
            parsed[key] = json.loads(text)
        except json.JSONDecodeError:
            parsed[key] = text
    return parsed


def load_factory(path: str, allowed: Collection[str]) -> Callable[..., nn.Module]:
    """Resolve ``"pkg.mod:factory"`` (or ``"pkg.mod:Class"``) to a callable, if ``allowed`` lists it.

    The allowlist is checked before anything is imported: importing a module
    runs its code, and the job file supplies the call's keyword arguments.
    """
    factories.check(path, allowed)
    module_name, attr = factories.split_path(path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise NotFoundError(f"cannot import {module_name!r} for torch_factory {path!r}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise NotFoundError(f"{module_name!r} has no {attr!r} (torch_factory {path!r})") from None
    if not callable(target):
        raise InvalidArgumentError(f"torch_factory {path!r} is not callable")
    return target


def build_model(
    spec: common_pb2.ModelSpec, model_dir: Path | None, *, factories_allowed: Collection[str] = ()
) -> nn.Module:
    """The job's model, on the CPU, in training mode (a factory only from ``factories_allowed``)."""
    kind = model_kind(spec)
    overrides = parse_overrides(spec.config_overrides)
    with _BUILD_LOCK:
        if kind is ModelKind.TORCH:
            model = _build_torch(spec, model_dir, overrides, factories_allowed)
        else:
            model = _build_auto(kind, model_dir, overrides)
    model.train()
    return model


def _build_auto(kind: ModelKind, model_dir: Path | None, overrides: dict[str, Any]) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification

    if model_dir is None or not (model_dir / CONFIG_NAME).is_file():
        raise NotFoundError(f"model directory {model_dir} holds no {CONFIG_NAME}")
    config = AutoConfig.from_pretrained(model_dir)
    for key, value in overrides.items():
        setattr(config, key, value)
    auto = AutoModelForCausalLM if kind is ModelKind.CAUSAL_LM else AutoModelForImageClassification
    model: nn.Module = auto.from_pretrained(model_dir, config=config)
    return model


def _build_torch(
    spec: common_pb2.ModelSpec, model_dir: Path | None, overrides: dict[str, Any], allowed: Collection[str]
) -> nn.Module:
    if not spec.torch_factory:
        raise InvalidArgumentError("a torch model needs torch_factory ('pkg.module:factory')")
    factory = load_factory(spec.torch_factory, allowed)
    # NOTE: seeding makes a weightless factory build the same θ_0 in every process; the
    # trainers still pull θ_global from the parameter server before their first step.
    with torch.random.fork_rng():
        torch.manual_seed(FACTORY_SEED)
        model = factory(**overrides)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"torch_factory {spec.torch_factory!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    if model_dir is not None and (model_dir / WEIGHTS_NAME).is_file():
        from safetensors.torch import load_model

        load_model(model, str(model_dir / WEIGHTS_NAME), strict=True)
    return model


def save_model_dir(model: nn.Module, out_dir: Path, spec: common_pb2.ModelSpec) -> Path:
    """Write ``model`` as ``config.json`` + ``model.safetensors`` (what ``from_pretrained`` reads)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if model_kind(spec) is ModelKind.TORCH:
        from safetensors.torch import save_model

        save_model(model, str(out_dir / WEIGHTS_NAME))
        config = {
            "hypha_model_type": ModelKind.TORCH.value,
            "torch_factory": spec.torch_factory,
            "config_overrides": dict(spec.config_overrides),
        }
        (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        model.save_pretrained(out_dir)  # type: ignore[operator]
    return out_dir


# ---- tiny models for tests, the demo and benchmarks ----------------------------------------


def tiny_gpt2_config(**overrides: Any) -> Any:
    """A ~0.12M-parameter GPT-2 over the byte vocabulary (258 ids) of the synthetic corpora."""
    from transformers import GPT2Config

    from hypha.datasets.synthetic import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE

    settings: dict[str, Any] = {
        "vocab_size": BYTE_VOCAB_SIZE,
        "n_positions": 64,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 2,
        "bos_token_id": BYTE_EOS_ID,
        "eos_token_id": BYTE_EOS_ID,
        "pad_token_id": BYTE_PAD_ID,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        **overrides,
    }
    return GPT2Config(**settings)


#: The demo's model (``save_arithmetic_model``): ~0.63M parameters, enough to learn 3-digit
#: addition with reversed answers in a few thousand steps, and ~50 ms a step on one CPU thread.
ARITHMETIC_GPT2 = {"n_embd": 128, "n_layer": 3, "n_head": 4, "n_positions": 16}
#: The spread of the demo model's initial position embeddings (GPT-2 draws every weight at
#: 0.02). Digit k of the answer is the sum of the operands' digits at two fixed positions plus a
#: carry from the two before them, so the model must tell positions apart before it can learn
#: the carry; with positions as faint as the digits, it sat on the carry-less plateau (~10 %
#: held-out exact match) for 750 steps in one data order and more than 2,500 in two of five.
#: Drawn at 0.3, with the demo's inner rate and weight decay, data parallel reached 90 % at
#: 550-900 steps in four orders of five and the demo's job in 14 runs of 15 within 26 rounds
#: (docs/performance.md, "A steadier exit from the plateau").
ARITHMETIC_POSITION_STD = 0.3


def save_arithmetic_model(out_dir: Path, *, seed: int = 0) -> Path:
    """The demo's GPT-2 for the synthetic arithmetic corpus, seeded, as a ``from_pretrained`` dir."""
    return save_tiny_model(
        ModelKind.CAUSAL_LM, out_dir, seed=seed, position_std=ARITHMETIC_POSITION_STD, **ARITHMETIC_GPT2
    )


def refresh_arithmetic_model(model_dir: Path, *, seed: int = 0) -> bool:
    """Write the demo's initial model into ``model_dir`` unless the very same files are there;
    True when it wrote. A model an earlier release left there (positions drawn at 0.02) is
    replaced: the demo's settings and figures are for this one."""
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        save_arithmetic_model(fresh, seed=seed)
        if all(
            (model_dir / path.name).is_file() and filecmp.cmp(path, model_dir / path.name, shallow=False)
            for path in fresh.iterdir()
        ):
            return False
        if model_dir.exists():
            shutil.rmtree(model_dir)
        fresh.rename(model_dir)
        return True
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def tiny_vit_config(**overrides: Any) -> Any:
    """A ~18k-parameter ViT for 16x16 one-channel images of the four synthetic shapes."""
    from transformers import ViTConfig

    from hypha.datasets.synthetic import DEFAULT_IMAGE_SIZE, SHAPE_NAMES

    settings: dict[str, Any] = {
        "image_size": DEFAULT_IMAGE_SIZE,
        "patch_size": 4,
        "num_channels": 1,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "num_labels": len(SHAPE_NAMES),
        "id2label": dict(enumerate(SHAPE_NAMES)),
        "label2id": {name: i for i, name in enumerate(SHAPE_NAMES)},
        **overrides,
    }
    return ViTConfig(**settings)


def save_tiny_model(
    kind: ModelKind | str,
    out_dir: Path,
    *,
    seed: int = 0,
    position_std: float | None = None,
    **overrides: Any,
) -> Path:
    """Create a tiny causal LM or ViT with seeded weights and ``save_pretrained`` it into ``out_dir``;
    ``position_std`` redraws a causal LM's position embeddings at that spread."""
    from transformers import GPT2LMHeadModel, ViTForImageClassification

    kind = ModelKind(kind)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model: Any
        if kind is ModelKind.CAUSAL_LM:
            model = GPT2LMHeadModel(tiny_gpt2_config(**overrides))
            if position_std is not None:
                nn.init.normal_(model.transformer.wpe.weight, std=position_std)
        elif kind is ModelKind.VISION_CLASSIFICATION:
            model = ViTForImageClassification(tiny_vit_config(**overrides))
        else:
            raise InvalidArgumentError(f"no tiny model of kind {kind}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


# ---- losses ------------------------------------------------------------------------------

#: The slice tensors each model kind is called with (a torch model gets them all).
MODEL_INPUTS: dict[ModelKind, tuple[str, ...]] = {
    ModelKind.CAUSAL_LM: ("input_ids", "attention_mask", "labels"),
    ModelKind.VISION_CLASSIFICATION: ("pixel_values", "labels"),
}


def batch_loss(model: nn.Module, kind: ModelKind, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The scalar training loss of ``batch`` for this kind of model."""
    if kind is ModelKind.CAUSAL_LM:
        inputs = {k: batch[k] for k in MODEL_INPUTS[kind] if k in batch}
        if "labels" not in inputs:
            # Hugging Face shifts the labels itself; padding (mask 0) is ignored.
            labels = inputs["input_ids"].clone()
            if "attention_mask" in inputs:
                labels[inputs["attention_mask"] == 0] = -100
            inputs["labels"] = labels
        return _loss_of(model(**inputs), inputs)
    if kind is ModelKind.VISION_CLASSIFICATION:
        inputs = {k: batch[k] for k in MODEL_INPUTS[kind] if k in batch}
        return _loss_of(model(**inputs), inputs)
    return _loss_of(model(**batch), batch)


def _loss_of(output: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None:
        logits = getattr(output, "logits", output if isinstance(output, torch.Tensor) else None)
        if isinstance(logits, torch.Tensor) and "labels" in batch:
            loss = nn.functional.cross_entropy(logits.flatten(0, -2), batch["labels"].flatten())
    if not isinstance(loss, torch.Tensor):
        raise InvalidArgumentError(
            "the model returned no loss: return a scalar tensor, an object or dict with 'loss', "
            "or logits with 'labels' in the batch"
        )
    return loss


@torch.no_grad()
def evaluate_loss(model: nn.Module, kind: ModelKind, batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """Mean loss over ``batches`` without training (the model is left in training mode)."""
    model.eval()
    try:
        losses = [float(batch_loss(model, kind, batch)) for batch in batches]
    finally:
        model.train()
    return sum(losses) / len(losses)
