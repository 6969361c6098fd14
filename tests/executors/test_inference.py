"""The inference executor over a fake bridge: a vision classifier scored on shape slices."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import ViTForImageClassification

from hypha.datasets import synthetic
from hypha.models import save_tiny_model
from hypha.testing.executors import FakeNetwork, write_slices
from hypha.v1 import common_pb2
from hypha.worker.executors.inference import METRICS_NAME, OUTPUTS_NAME, InferenceExecutor

SAMPLES = 48


def network(tmp_path: Path, model_type: int) -> FakeNetwork:
    model_dir = save_tiny_model(
        "vision-classification" if model_type == common_pb2.MODEL_TYPE_VISION_CLASSIFICATION else "causal-lm",
        tmp_path / "model",
        seed=1,
    )
    slices = write_slices(synthetic.generate("shapes", SAMPLES, seed=2), tmp_path / "data", "shapes", 16)
    spec = common_pb2.JobSpec(
        inference=common_pb2.InferenceJobSpec(
            model=common_pb2.ModelSpec(local_path="/unused", type=model_type),  # type: ignore[arg-type]
            dataset="shapes",
            max_samples=SAMPLES,
            batch_size=20,
        )
    )
    return FakeNetwork(spec, tmp_path / "work", model_dir, ("w",), slices={"w": slices})


async def test_a_classifier_is_scored_on_every_sample_with_the_accuracy_computed_directly(
    tmp_path: Path,
) -> None:
    net = network(tmp_path, common_pb2.MODEL_TYPE_VISION_CLASSIFICATION)

    code = await InferenceExecutor(net.bridge("w")).run()

    assert code == 0, net.statuses
    data = synthetic.generate("shapes", SAMPLES, seed=2).tensors
    model = ViTForImageClassification.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        predicted = model(pixel_values=data["pixel_values"]).logits.argmax(-1)
    result = net.results["w"]
    rows = [json.loads(line) for line in (result / OUTPUTS_NAME).read_text().splitlines()]
    assert [r["prediction"] for r in rows] == predicted.tolist()
    assert [r["label"] for r in rows] == data["labels"].tolist()
    accuracy = float((predicted == data["labels"]).float().mean())
    assert json.loads((result / METRICS_NAME).read_text())["accuracy"] == accuracy
    assert net.metrics[0][2]["accuracy"] == accuracy and net.metrics[0][2]["samples"] == SAMPLES
    assert net.statuses["w"][-1][0] == "succeeded"


async def test_a_text_model_on_an_image_dataset_fails_saying_why(tmp_path: Path) -> None:
    net = network(tmp_path, common_pb2.MODEL_TYPE_CAUSAL_LM)

    code = await InferenceExecutor(net.bridge("w")).run()

    assert code == 1 and "w" not in net.results
    state, message = net.statuses["w"][-1]
    assert state == "failed" and "holds no input_ids" in message
