"""Running a model without training it: greedy generation with exact match, classification accuracy.

The one place that scores a model: the inference executor
(``hypha.worker.executors.inference``) and the demo's held-out evaluation
(``hypha.client.demo_eval``) both call it, so a job's ``exact_match`` and the
demo's figure are the same computation.

- Causal LM rows (``input_ids``/``labels`` as the built-in datasets write
  them): the prompt is everything before the first labelled token, the
  expected answer is the labelled span's first line. Generation is greedy
  (argmax), prompts of one length batched together: a handful of forward
  passes where ``generate()`` per prompt would take minutes on a CPU.
- Text is byte-level (ids 0-255 are bytes, ``hypha.datasets.synthetic``): the
  tokenizer every built-in dataset uses, so inline prompts need no tokenizer.
- Vision classification rows (``pixel_values``/``labels``): argmax of the
  logits against the label.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hypha.datasets.synthetic import IGNORE_INDEX, decode_bytes, encode_bytes

#: Tokens generated per prompt when neither the job nor an expected answer says how many.
DEFAULT_NEW_TOKENS = 16


@dataclass(frozen=True)
class Prompt:
    """One generation input: token ids and the expected answer ("" when unknown)."""

    ids: list[int]
    answer: str = ""

    @classmethod
    def from_text(cls, prompt: str, answer: str = "") -> Prompt:
        return cls(encode_bytes(prompt), answer)


def prompts_from_rows(input_ids: torch.Tensor, labels: torch.Tensor | None) -> list[Prompt]:
    """Prompts and answers from causal-LM rows: the prompt ends where the labels start."""
    out = []
    for i, row in enumerate(input_ids.tolist()):
        if labels is None:
            out.append(Prompt(row))
            continue
        labelled = [j for j, value in enumerate(labels[i].tolist()) if value != IGNORE_INDEX]
        start = labelled[0] if labelled else len(row)
        answer = completion_text(row[start : labelled[-1] + 1]) if labelled else ""
        out.append(Prompt(row[:start], answer))
    return out


def completion_text(ids: Sequence[int]) -> str:
    """The first line of a byte-level completion (special ids dropped), as exact match reads it."""
    return decode_bytes(ids).split("\n", 1)[0].strip()


def is_exact_match(completion: str, answer: str) -> bool:
    return completion.split("\n", 1)[0].strip() == answer.strip()


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence the model takes (GPT-2's ``n_positions``), if its config says."""
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@torch.no_grad()
def greedy_generate(
    model: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int, *, batch_size: int = 64
) -> list[list[int]]:
    """Each prompt's greedy continuation of ``new_tokens`` ids (fewer where the model's context ends)."""
    device = next(model.parameters(), torch.empty(0)).device
    limit = position_limit(model)
    out: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        for indices in _same_length_batches(prompts, batch_size):
            ids = torch.tensor([list(prompts[i]) for i in indices], dtype=torch.long, device=device)
            steps = new_tokens if limit is None else max(0, min(new_tokens, limit - ids.shape[1]))
            start = ids.shape[1]
            for _ in range(steps):
                next_ids = model(input_ids=ids).logits[:, -1].argmax(-1)
                ids = torch.cat([ids, next_ids[:, None]], dim=1)
            for row, i in zip(ids[:, start:].tolist(), indices, strict=True):
                out[i] = row
    finally:
        model.train(was_training)
    return out


def _same_length_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> Iterator[list[int]]:
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), max(1, batch_size)):
            yield indices[start : start + batch_size]


def answer_tokens(prompts: Sequence[Prompt]) -> int:
    """Tokens to generate so the longest expected answer and its newline fit."""
    longest = max((len(encode_bytes(p.answer)) for p in prompts if p.answer), default=0)
    return longest + 1 if longest else DEFAULT_NEW_TOKENS


@torch.no_grad()
def classify(model: nn.Module, pixel_values: torch.Tensor, *, batch_size: int = 64) -> list[int]:
    """The predicted class of each image (argmax of the logits)."""
    device = next(model.parameters(), torch.empty(0)).device
    was_training = model.training
    model.eval()
    predictions: list[int] = []
    try:
        for start in range(0, len(pixel_values), max(1, batch_size)):
            batch = pixel_values[start : start + batch_size].to(device)
            output = model(pixel_values=batch)
            logits = getattr(output, "logits", output)
            predictions.extend(int(v) for v in logits.argmax(-1).tolist())
    finally:
        model.train(was_training)
    return predictions


__all__ = [
    "DEFAULT_NEW_TOKENS",
    "Prompt",
    "answer_tokens",
    "classify",
    "completion_text",
    "greedy_generate",
    "is_exact_match",
    "position_limit",
    "prompts_from_rows",
]
