"""A DiLoCo trainer written from the reference system's job bridge API alone.

It imports nothing of this project: it speaks HTTP/1.1 over the Unix socket
with the standard library, reads the job JSON the reference passes
(``--socket --work-dir --job``, as the reference's ``[[executors]]`` args
fill them) and does what the reference's own trainer
(``executors/accelerate``) does, with torch on a causal LM:

1. fetch the model (``POST /resources/fetch`` with ``config.model.artifact``);
2. subscribe to the results (``POST /resources/receive``, an event stream);
3. train on slices (``POST /resources/fetch`` with ``config.data``), reporting
   each batch (``{"status": {"batch_size"}}``) until the answer is
   ``ScheduleUpdate`` and its counter runs out;
4. report ``"update"``, save θ_local - θ_before and send it
   (``POST /resources/send`` to ``config.updates``), report its metrics;
5. wait for the next event, add the received file to θ_before, report
   ``"update-received"``; ``Done`` ends, anything else trains another round.

It writes ``reference-trainer.json`` (rounds, losses) into the work dir for tests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("hypha", timeout=None)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.socket_path)
        self.sock = sock


class Session:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def post(self, path: str, body: Any) -> Any:
        conn = UnixConnection(self.socket_path)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{path}: {resp.status} {data!r}")
            return json.loads(data) if data else None
        finally:
            conn.close()

    def events(self, resource: Any, path: str) -> Iterator[Any]:
        """The receive stream's ``data:`` values (comments and other fields skipped)."""
        conn = UnixConnection(self.socket_path)
        body = json.dumps({"resource": resource, "path": path})
        conn.request(
            "POST",
            "/resources/receive",
            body,
            {"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"receive: {resp.status} {resp.read()!r}")
        while True:
            line = resp.readline()
            if not line:
                return
            field, _, value = line.decode().rstrip("\n").partition(":")
            if field == "data":
                yield json.loads(value)


def batches(
    session: Session, data: Any, work_dir: str, inputs: list[str], size: int
) -> Iterator[dict[str, Any]]:
    """Batches of ``size`` rows from the slices the scheduler hands out, slice after slice."""
    pending: dict[str, torch.Tensor] = {}
    while True:
        files = session.post("/resources/fetch", data)
        loaded = load_file(os.path.join(work_dir, files[0]["path"]))
        columns = {name: loaded[name] for name in inputs if name in loaded}
        pending = {k: torch.cat([pending[k], v]) if k in pending else v for k, v in columns.items()}
        while pending and next(iter(pending.values())).shape[0] >= size:
            yield {k: v[:size] for k, v in pending.items()}
            pending = {k: v[size:] for k, v in pending.items()}


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, every entry its own contiguous CPU copy (tied weights included)."""
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}


def main(socket_path: str, work_dir: str, job_json: str) -> None:
    session = Session(socket_path)
    job = json.loads(job_json)
    executor = job["executor"]
    assert executor["class"] == "train", executor
    config = executor["config"]

    session.post("/resources/fetch", config["model"]["artifact"])
    model = AutoModelForCausalLM.from_pretrained(os.path.join(work_dir, "artifacts"))
    opt = config["optimizer"]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt["learning-rate"], betas=tuple(opt.get("betas") or (0.9, 0.999))
    )
    previous = os.path.join(work_dir, "0_global_weights.safetensors")
    save_file(state_of(model), previous)
    data = batches(session, config["data"], work_dir, config["model"]["input-names"], config["batch_size"])
    events = session.events(config["results"], "incoming")
    log: dict[str, Any] = {"rounds": 0, "losses": []}

    epoch = 1
    while True:
        losses = []
        counter = -1
        while counter != 0:
            batch = next(data)
            optimizer.zero_grad()
            inputs = dict(batch)
            if "labels" not in inputs:
                inputs["labels"] = inputs["input_ids"].clone()
                if "attention_mask" in inputs:
                    inputs["labels"][inputs["attention_mask"] == 0] = -100
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            answer = session.post("/status/send", {"status": {"batch_size": batch["input_ids"].shape[0]}})
            counter = answer["counter"] if answer["type"] == "ScheduleUpdate" else counter - 1

        session.post("/status/send", "update")
        name = f"{epoch}_local_gradients.safetensors"
        local = state_of(model)
        with safe_open(previous, framework="pt") as before:
            gradients = {k: local[k] - before.get_tensor(k) for k in before.keys()}
        save_file(gradients, os.path.join(work_dir, name))
        session.post("/resources/send", {"resource": config["updates"], "path": name})
        mean = sum(losses) / len(losses)
        session.post("/status/send", {"metrics": {"round": epoch, "metrics": {"loss": mean}}})
        log["losses"].append(mean)

        pointer = next(events)
        update = load_file(os.path.join(work_dir, pointer["path"]))
        with safe_open(previous, framework="pt") as before:
            merged = {k: before.get_tensor(k) + update[k] for k in before.keys()}
        model.load_state_dict(merged)
        save_file(state_of(model), previous)
        log["rounds"] = epoch
        with open(os.path.join(work_dir, "reference-trainer.json"), "w") as out:
            json.dump(log, out)
        answer = session.post("/status/send", "update-received")
        if answer["type"] == "Done":
            break
        epoch += 1
    print(f"reference trainer: {epoch} rounds, losses {log['losses']}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    main(args.socket, args.work_dir, args.job)
    sys.exit(0)
