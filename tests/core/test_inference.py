"""Scoring helpers: prompts and answers from dataset rows; batched greedy decoding equals one at a time."""

from __future__ import annotations

import torch
from transformers import GPT2LMHeadModel

from hypha import inference
from hypha.datasets import synthetic
from hypha.models import tiny_gpt2_config


def test_rows_split_into_the_prompt_and_the_labelled_answer() -> None:
    rows = synthetic.arithmetic_rows([(12, 35), (999, 1)], synthetic.arithmetic_line_length(999))
    prompts = inference.prompts_from_rows(
        torch.from_numpy(rows["input_ids"]), torch.from_numpy(rows["labels"])
    )
    assert [(synthetic.decode_bytes(p.ids), p.answer) for p in prompts] == [
        ("012+035=", "74"),
        ("999+001=", "0001"),
    ]
    assert inference.answer_tokens(prompts) == 5  # the longest answer and its newline


def test_batched_greedy_decoding_of_mixed_lengths_equals_one_prompt_at_a_time() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_positions=12))
    prompts = [list(b"12+3="), list(b"7+8="), list(b"100+200="), list(b"1+1=")]

    batched = inference.greedy_generate(model, prompts, 6, batch_size=2)

    for prompt, got in zip(prompts, batched, strict=True):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(min(6, 12 - len(prompt))):  # the model's context ends at 12 positions
                tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
        assert got == tokens[len(prompt) :]
    assert len(batched[2]) == 4 and model.training  # capped by n_positions; the mode is restored


def test_exact_match_reads_the_first_line_only() -> None:
    assert inference.is_exact_match(inference.completion_text(list(b"74\n99")), "74")
    assert not inference.is_exact_match("741", "74")
