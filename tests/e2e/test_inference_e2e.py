"""Inference jobs end to end: a real local cluster scores a model on a dataset or on inline prompts.

The path under test: ``SubmitJob`` -> inference run (providers from the DHT,
one ``inference`` lease) -> ``Worker.DispatchJob`` -> the inference executor
(model fetched from the worker's local model roots, or shipped from a finished
job's result; slices streamed from the data node) -> metrics and
``outputs.jsonl``/``metrics.json`` back through ``GetJobMetrics`` and
``hypha fetch``. The completions are checked against a plain per-prompt greedy
loop run here, in this process, on the same model and rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from hypha import bundles
from hypha.datasets.format import Dataset, load_slice_file
from hypha.datasets.synthetic import IGNORE_INDEX, decode_bytes
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e import DATASET, E2ECluster
from tests.helpers import cli

pytestmark = pytest.mark.timeout(120)

SAMPLES = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(tmp_path_factory.mktemp("inference-e2e"), workers=1, overrides={"worker": []})
    c.prepare(samples=256)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def expected_rows(cluster: E2ECluster, model_dir: Path, count: int) -> list[tuple[str, str, str]]:
    """(prompt, completion's first line, answer) of the first ``count`` rows, by a naive greedy loop."""
    dataset = Dataset.open(cluster.cluster.data_dir / DATASET)
    ids, labels = [], []
    for index in range(dataset.manifest.slice_count):
        tensors = load_slice_file(dataset.slice_path(index))
        ids.extend(tensors["input_ids"].tolist())
        labels.extend(tensors["labels"].tolist())
    spans = []
    for label in labels[:count]:
        marked = [j for j, v in enumerate(label) if v != IGNORE_INDEX]
        spans.append((marked[0], marked[-1] + 1))
    steps = max(end - start for start, end in spans)  # the longest answer and its newline, for all
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = []
    for row, (start, end) in zip(ids[:count], spans, strict=True):
        answer = decode_bytes(row[start:end]).split("\n", 1)[0]
        prompt = decode_bytes(row[:start])
        rows.append((prompt, greedy_line(model, prompt, steps), answer))
    return rows


async def metrics_of(cluster: E2ECluster, job_id: str) -> dict[str, float]:
    async with cluster.channel() as channel:
        reply = await scheduler_pb2_grpc.SchedulerStub(channel).GetJobMetrics(
            scheduler_pb2.GetJobMetricsRequest(job_id=job_id), timeout=10
        )
    return {p.name: p.value for p in reply.points}


async def test_a_saved_model_scores_the_dataset_and_the_results_are_fetched(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    toml = f"""
[job]
kind = "inference"
name = "sums"
dataset = "{DATASET}"
max_samples = {SAMPLES}
timeout_s = 60
[job.model]
local_path = "{cluster.model_dir}"
"""
    job_id = await cluster.submit(toml)
    expected = await asyncio.to_thread(expected_rows, cluster, cluster.model_dir, SAMPLES)

    job = await cluster.wait(job_id, 90)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    env = {**os.environ, "HYPHA_STATE_DIR": str(cluster.cluster.state_dir)}
    fetched = await asyncio.to_thread(
        subprocess.run,
        [*cli("hypha"), "fetch", job_id, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert fetched.returncode == 0, fetched.stderr
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["completion"], r["answer"]) for r in rows] == expected
    hits = sum(completion == answer for _, completion, answer in expected)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["samples"] == SAMPLES and metrics["exact_match"] == pytest.approx(hits / SAMPLES)
    reported = await metrics_of(cluster, job_id)
    assert reported["exact_match"] == pytest.approx(hits / SAMPLES) and reported["samples"] == SAMPLES
    assert f"{SAMPLES} samples, exact_match {hits / SAMPLES:.4f}" in job.reason  # what hypha status shows


async def test_a_finished_jobs_result_is_the_model_for_inline_prompts(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    # A task job that ships the cluster's saved model and declares it as its output: once it
    # succeeded, its result is the model an inference job names by job id.
    producer = await cluster.submit(
        "\n".join(
            [
                "[job]",
                'name = "make-model"',
                f"command = {json.dumps(sys.executable)}",
                'args = ["-c", "pass"]',
                f"files = [{json.dumps(cluster.model_dir.name)}]",
                f"outputs = [{json.dumps(cluster.model_dir.name + '/')}]",
                "timeout_s = 60",
            ]
        ),
        files_bundle=bundles.pack([cluster.model_dir.name], cluster.model_dir.parent),
    )
    made = await cluster.wait(producer, 60)
    assert made.state == common_pb2.JOB_STATE_SUCCEEDED, f"{made.reason}\n{cluster.logs()}"
    toml = f"""
[job]
name = "inline"
model_job = "{producer}"
inputs = [{{ prompt = "012+035=", answer = "74" }}, {{ prompt = "500+500=" }}]
max_new_tokens = 4
"""
    job_id = await cluster.submit(toml)

    job = await cluster.wait(job_id, 60)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    files = await cluster.fetch_result(job_id, tmp_path / "out")
    assert sorted(f.name for f in files) == ["metrics.json", "outputs.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(cluster.model_dir).eval()
    prompts = ("012+035=", "500+500=")
    expected = [greedy_line(model, prompt, 4) for prompt in prompts]
    assert [(r["prompt"], r["completion"]) for r in rows] == list(zip(prompts, expected, strict=True))
    assert rows[0]["exact_match"] == (expected[0] == "74") and "answer" not in rows[1]
    reported = await metrics_of(cluster, job_id)
    assert reported["samples"] == 2 and reported["exact_match"] == float(expected[0] == "74")


def greedy_line(model: torch.nn.Module, prompt: str, steps: int) -> str:
    """The first line of ``steps`` greedy tokens after ``prompt`` (byte-level), one token at a time."""
    tokens = list(prompt.encode())
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return decode_bytes(tokens[len(prompt) :]).split("\n", 1)[0].strip()


async def test_a_bad_model_job_fails_the_job_naming_it(cluster: E2ECluster) -> None:
    job_id = await cluster.submit('[job]\nmodel_job = "no-such-job"\ninputs = [{ prompt = "1+1=" }]')

    job = await cluster.wait(job_id, 30)

    assert job.state == common_pb2.JOB_STATE_FAILED
    assert "model_job no-such-job: must be a succeeded job" in job.reason


async def test_a_dataset_no_data_node_announces_is_refused_at_submit(cluster: E2ECluster) -> None:
    toml = f'[job]\nkind = "inference"\ndataset = "nope"\n[job.model]\nlocal_path = "{cluster.model_dir}"'

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.submit(toml)

    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in (err.value.details() or "")
