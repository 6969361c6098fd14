"""The ``inference`` executor: a model run over a dataset's slices or inline inputs, scored.

    python -m hypha.worker.executors.inference

The worker starts it with the job bridge's socket in ``HYPHA_BRIDGE_SOCKET``.
It builds the job's model (``hypha.models``) from what the worker fetched
(a repository or a local path under ``local_model_roots``) or from the
finished job's result the scheduler pushes right after the dispatch (tensor
kind ``model``: a tar.gz checked against the spec's ``model_bundle_sha256``
and unpacked into the work dir's ``model``), takes its inputs (every slice the scheduler hands
out for the dataset, or the spec's inline prompts), and scores them with
``hypha.inference``: greedy generation and exact match for a causal LM,
accuracy for a vision classifier. It writes ``outputs.jsonl`` (one line per
sample) and ``metrics.json`` into ``result/``, reports the metrics (round 0)
and hands the folder over as the job's result (``hypha fetch``).

Decisions (NOTE):
- Samples are scored in slice order whatever order the slices arrived in,
  so the same job gives the same ``outputs.jsonl``.
- The bridge answering "unavailable" (the scheduler cannot be reached for
  now) is retried a few times before the job fails; no slice means the
  dataset is exhausted (the scheduler hands each slice out once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from hypha import bundles, factories, inference, models
from hypha.datasets.format import load_slice_file
from hypha.datasets.synthetic import decode_bytes
from hypha.errors import FailedPreconditionError, NotFoundError, UnavailableError
from hypha.v1 import common_pb2
from hypha.worker.executors import process

logger = logging.getLogger("hypha.worker.executors.inference")

#: Where a ``model_job``'s result is unpacked, in the work dir.
MODEL_BUNDLE_DIR = "model"
#: Tensor kind the scheduler pushes that result as.
MODEL_KIND = "model"
#: How long the executor waits for it.
MODEL_WAIT_S = 600.0
RESULT_DIR = "result"
OUTPUTS_NAME = "outputs.jsonl"
METRICS_NAME = "metrics.json"
#: Tries of a slice request the bridge answers "unavailable".
SLICE_TRIES = 5


class Bridge(Protocol):
    """What this executor uses of ``hypha.bridge_client.BridgeClient`` (tests fake it)."""

    async def job(self) -> Any: ...
    async def fetch_resource(self, name: str) -> Path: ...
    async def inbox(self, kind: str, timeout_s: float) -> Any: ...
    async def next_slice(self) -> Any: ...
    async def metrics(self, round: int, values: Mapping[str, float]) -> None: ...
    async def result(self, path: Path) -> None: ...
    async def status(self, state: str, message: str) -> None: ...


def find_model_dir(root: Path) -> Path:
    """The shallowest folder under ``root`` holding a ``config.json`` (a job's result may nest it)."""
    found = sorted(root.rglob(models.CONFIG_NAME), key=lambda p: (len(p.parts), str(p)))
    if not found:
        raise NotFoundError(f"the model job's result holds no {models.CONFIG_NAME}")
    return found[0].parent


class InferenceExecutor:
    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    async def run(self) -> int:
        try:
            message = await self._run()
        except process.FAILURES as exc:
            return await process.report_failure(self.bridge, "inference", exc)
        await self.bridge.status("succeeded", message)
        return 0

    async def _run(self) -> str:
        job = await self.bridge.job()
        spec = job.spec if isinstance(job.spec, common_pb2.JobSpec) else job.spec_proto()
        if spec.WhichOneof("kind") != "inference":
            raise FailedPreconditionError("the inference executor needs an inference job spec")
        self.spec = spec.inference
        work_dir = Path(job.work_dir)
        if self.spec.model_job:
            model_dir: Path | None = await self._model_from_job(work_dir / MODEL_BUNDLE_DIR)
        elif self.spec.model.repository or self.spec.model.local_path:
            model_dir = await self.bridge.fetch_resource("model")
        else:
            model_dir = None  # a torch factory's seeded weights
        model = await asyncio.to_thread(
            models.build_model, self.spec.model, model_dir, factories_allowed=factories.from_env()
        )
        self.kind = models.model_kind(self.spec.model)
        started = time.monotonic()
        if self.spec.inputs:
            rows, figures = await asyncio.to_thread(self._generate, model, self._inline_prompts(), [])
        else:
            slices = await self._slices()
            rows, figures = await asyncio.to_thread(self._score_slices, model, slices)
        seconds = time.monotonic() - started
        figures["samples"] = float(len(rows))
        figures["seconds"] = round(seconds, 3)
        figures["samples_per_second"] = len(rows) / seconds if seconds > 0 else 0.0
        result = work_dir / RESULT_DIR
        await asyncio.to_thread(_write_result, result, rows, figures)
        await self.bridge.metrics(0, figures)
        await self.bridge.result(result)
        scored = ", ".join(f"{k} {figures[k]:.4f}" for k in ("exact_match", "accuracy") if k in figures)
        return f"{len(rows)} samples" + (f", {scored}" if scored else "")

    async def _model_from_job(self, target: Path) -> Path:
        """Wait for the scheduler's push of the model job's result; unpack it; its model folder."""
        deadline = time.monotonic() + MODEL_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            received = await self.bridge.inbox(MODEL_KIND, timeout_s=min(left, 60.0))
            if received is not None:
                bundle = bundles.from_payload(bytes(received.data))
                sha256 = self.spec.model_bundle_sha256
                await asyncio.to_thread(bundles.unpack, bundle, sha256, target)
                return await asyncio.to_thread(find_model_dir, target)
        raise NotFoundError(
            f"the result of model_job {self.spec.model_job} did not arrive in {MODEL_WAIT_S:g} s"
        )

    # ---- inputs ----------------------------------------------------------------------------

    def _limit(self, count: int) -> int:
        return min(count, int(self.spec.max_samples)) if self.spec.max_samples else count

    def _inline_prompts(self) -> list[inference.Prompt]:
        inputs = list(self.spec.inputs)[: self._limit(len(self.spec.inputs))]
        return [inference.Prompt.from_text(i.prompt, i.answer) for i in inputs]

    async def _slices(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Every slice the scheduler hands out (until ``max_samples`` rows), in slice order."""
        got: list[tuple[int, dict[str, torch.Tensor]]] = []
        rows = 0
        while not self.spec.max_samples or rows < self.spec.max_samples:
            info = await self._next_slice()
            if info is None:
                break
            tensors = await asyncio.to_thread(load_slice_file, info.path)
            got.append((int(info.index), tensors))
            rows += len(next(iter(tensors.values()))) if tensors else 0
        if not got:
            raise NotFoundError(f"no slice of dataset {self.spec.dataset!r} came")
        return sorted(got, key=lambda item: item[0])

    async def _next_slice(self) -> Any:
        for attempt in range(SLICE_TRIES):
            try:
                return await self.bridge.next_slice()
            except UnavailableError as exc:
                if attempt == SLICE_TRIES - 1:
                    raise
                logger.warning("no slice for now: %s", exc.message)
                await asyncio.sleep(1.0 + attempt)
        return None

    # ---- scoring (in a thread) ------------------------------------------------------------

    def _score_slices(
        self, model: torch.nn.Module, slices: list[tuple[int, dict[str, torch.Tensor]]]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        where: list[tuple[int, int]] = []
        if self.kind is models.ModelKind.VISION_CLASSIFICATION:
            pixels, labels = [], []
            for index, tensors in slices:
                if "pixel_values" not in tensors:
                    raise NotFoundError(f"slice {index} holds no pixel_values (not an image dataset)")
                pixels.append(tensors["pixel_values"])
                labels.append(tensors.get("labels", torch.full((len(tensors["pixel_values"]),), -1)))
                where.extend((index, row) for row in range(len(tensors["pixel_values"])))
            count = self._limit(len(where))
            return self._classify(model, torch.cat(pixels)[:count], torch.cat(labels)[:count], where)
        prompts: list[inference.Prompt] = []
        for index, tensors in slices:
            if "input_ids" not in tensors:
                raise NotFoundError(f"slice {index} holds no input_ids (not a text dataset)")
            found = inference.prompts_from_rows(tensors["input_ids"], tensors.get("labels"))
            prompts.extend(found)
            where.extend((index, row) for row in range(len(found)))
        count = self._limit(len(prompts))
        return self._generate(model, prompts[:count], where[:count])

    def _generate(
        self, model: torch.nn.Module, prompts: list[inference.Prompt], where: list[tuple[int, int]]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        new_tokens = int(self.spec.max_new_tokens) or inference.answer_tokens(prompts)
        completions = inference.greedy_generate(
            model, [p.ids for p in prompts], new_tokens, batch_size=int(self.spec.batch_size) or 64
        )
        rows: list[dict[str, Any]] = []
        hits = answered = 0
        for n, (prompt, ids) in enumerate(zip(prompts, completions, strict=True)):
            text = inference.completion_text(ids)
            row: dict[str, Any] = {"index": n}
            if where:
                row["slice"], row["row"] = where[n]
            row.update(prompt=decode_bytes(prompt.ids), completion=text)
            if prompt.answer:
                match = inference.is_exact_match(text, prompt.answer)
                row.update(answer=prompt.answer, exact_match=match)
                hits += match
                answered += 1
            rows.append(row)
        figures = {"exact_match": hits / answered} if answered else {}
        return rows, figures

    def _classify(
        self, model: torch.nn.Module, pixels: torch.Tensor, labels: torch.Tensor, where: list[tuple[int, int]]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        predictions = inference.classify(model, pixels, batch_size=int(self.spec.batch_size) or 64)
        rows: list[dict[str, Any]] = []
        hits = labelled = 0
        for n, (predicted, label) in enumerate(zip(predictions, labels.tolist(), strict=True)):
            slice_index, row_index = where[n]
            row: dict[str, Any] = {
                "index": n,
                "slice": slice_index,
                "row": row_index,
                "prediction": predicted,
            }
            if label >= 0:
                row.update(label=int(label), correct=predicted == label)
                hits += predicted == label
                labelled += 1
            rows.append(row)
        return rows, ({"accuracy": hits / labelled} if labelled else {})


def _write_result(result: Path, rows: list[dict[str, Any]], figures: Mapping[str, float]) -> None:
    result.mkdir(parents=True, exist_ok=True)
    with (result / OUTPUTS_NAME).open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, sort_keys=True) + "\n")
    (result / METRICS_NAME).write_text(json.dumps(dict(figures), indent=2, sort_keys=True) + "\n")


def main() -> None:
    process.main(lambda bridge: InferenceExecutor(bridge).run())


if __name__ == "__main__":
    main()
