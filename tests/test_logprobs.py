"""Log-probabilities of the generated tokens and stop token ids, in the library (the served API: test_serve.py).

The reported log-probabilities must be the target's own: the log-softmax of the logits one plain forward pass
of the target over prompt + output gives at each position, computed here independently of hetspec.
"""

from __future__ import annotations

import pytest
import torch

from hetspec import Engine
from hetspec.config import BatchingConfig

PROMPT = "def fibonacci(n):\n"
# (algorithm, sampling, speculation): chains, a SLEM tree, rejection sampling, the target alone
CASES = [
    ("slem", {"temperature": 0.0}, {"draft_tokens": 4}),
    ("slem", {"temperature": 0.0}, {"tree_width": 3, "draft_tokens": 3}),
    ("tli", {"temperature": 0.8, "seed": 5}, {"draft_tokens": 3}),
    ("ar", {"temperature": 1.0, "seed": 7, "top_k": 20}, {}),
]


@pytest.fixture(scope="module")
def engine(gemma, smollm):
    return Engine(gemma, smollm, batching=BatchingConfig(max_batch_size=4, prefill_chunk_tokens=8))


def independent_log_probs(target, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), vocab]: the target's raw log-softmax before each output token, one forward pass."""
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)


@pytest.mark.parametrize("algorithm,sampling,speculation", CASES)
def test_logprobs_are_the_targets_own_log_softmax_at_each_generated_token(engine, gemma, algorithm, sampling,
                                                                          speculation):
    params = {"max_new_tokens": 12, "logprobs": 3, "ignore_eos": True, **sampling}
    result = engine.generate(PROMPT, params, speculation={"algorithm": algorithm, **speculation})
    plain = engine.generate(PROMPT, {**params, "logprobs": None}, speculation={"algorithm": algorithm, **speculation})
    assert plain.logprobs is None and plain.token_ids == result.token_ids  # asking for them changes nothing else
    assert [entry.token_id for entry in result.logprobs] == result.token_ids
    expected = independent_log_probs(gemma, gemma.encode_prompt(PROMPT), result.token_ids)
    for position, entry in enumerate(result.logprobs):
        row = expected[position]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=2e-3)
        assert len(entry.top) == 3
        top_values, top_ids = row.topk(3)
        assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=2e-3)
        assert entry.top[0][0] == int(top_ids[0]) or abs(float(top_values[0] - top_values[1])) < 1e-3
        if sampling["temperature"] == 0.0:  # greedy: the generated token is the most likely one
            assert entry.top[0][0] == entry.token_id


def test_logprobs_of_a_batch_follow_each_requests_released_ids_through_a_stop_string(engine, gemma):
    stop = engine.generate(PROMPT, {"max_new_tokens": 24, "ignore_eos": True}).text[8:12]
    params = [{"max_new_tokens": 24, "logprobs": 0, "stop": [stop]}, {"max_new_tokens": 9, "logprobs": 1},
              {"max_new_tokens": 9}]
    results = engine.generate_batch([PROMPT, "The capital of France", "Once upon a time"], params,
                                    speculation={"algorithm": "slem"})
    stopped, short, without = results
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    for result in (stopped, short):
        assert [entry.token_id for entry in result.logprobs] == result.token_ids
    assert all(entry.top == [] for entry in stopped.logprobs) and all(len(entry.top) == 1 for entry in short.logprobs)
    assert without.logprobs is None


@pytest.mark.parametrize("algorithm", ["slem", "tli", "ar"])
def test_stop_token_ids_end_the_output_after_the_first_such_token(engine, algorithm):
    params = {"max_new_tokens": 20, "ignore_eos": True}
    full = engine.generate(PROMPT, params, speculation={"algorithm": algorithm})
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    stopped = engine.generate(PROMPT, {**params, "stop_token_ids": [stop_id, 10**9]},
                              speculation={"algorithm": algorithm})
    assert stopped.token_ids == full.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and full.text.startswith(stopped.text)
