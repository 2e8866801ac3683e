"""Batched decoding (hetspec/step.py, hetspec/kv.py) is exact: every request of a batch gets the tokens the
target alone gives it at batch size 1.

Greedy in float32 on the real pair (Gemma 3 270M target, SmolLM2 135M drafter): batches that mix prompt
lengths, algorithms and parameters, requests that join mid-way (a batch of 3 slots for 7 requests) and leave
early. The reference is transformers' own greedy ``generate`` of the target alone, batch size 1, so it shares
no code with what is tested. Batched matrix products may round differently from batch 1: where a token
differs, the target's top-2 logit margin at the first differing position (from a batch-1 pass over the
common prefix) must be below TIE_MARGIN, i.e. the two tokens were tied to float32 rounding; any other
difference fails. The count of such ties is printed (``-s``) and bounded.
"""

from __future__ import annotations

import threading
import pytest
import torch

from synthetic import drafter_tokenizer, language_model, target_tokenizer
from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.adaptive import (BUDGET_WINDOW_S, DRAFT_MARGIN, EXPLORE, EXPLORE_BUDGET, EXPLORE_MAX, HOPELESS_BUDGET,
                              MIN_STEPS, OWN_PRIOR_STEPS, PRIOR_ROWS, PRIOR_TOKENS, SECONDS_KEPT, LoadAdaptive)
from hetspec.config import BatchingConfig
from hetspec.step import BatchDecoder
from hetspec.forward import forward
from hetspec.kv import Feed
from hetspec.passes import SharedPasses, Steps, run_alone, run_lockstep
from hetspec.prefill import prefill

TIE_MARGIN = 1e-4

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n\n# a function that normalises the rows of a matrix\ndef",
    "Roses are red,",
]
# mixed algorithms and parameters in one batch: budgets, stop strings, trees, adaptive k
REQUESTS = [
    ("slem", {"max_new_tokens": 16}, {}),
    ("tli", {"max_new_tokens": 7}, {}),
    ("ar", {"max_new_tokens": 14}, {}),
    ("slrs", {"max_new_tokens": 12, "stop": [" the "]}, {}),
    ("slem", {"max_new_tokens": 12}, {"tree_width": 3, "draft_tokens": 4}),
    ("slem", {"max_new_tokens": 10}, {"adaptive": True, "draft_tokens": 2}),
    ("tli", {"max_new_tokens": 15}, {"draft_tokens": 3}),
]


def reference_greedy(target, prompt: str, max_new_tokens: int) -> list[int]:
    """The target alone at batch size 1, by transformers' own generate (EOS ends it, as in hetspec)."""
    prompt_ids = target.encode_prompt(prompt)
    with torch.inference_mode():
        output = target.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)
    return output[0, len(prompt_ids):].tolist()


def top2_margin(target, prompt_ids: list[int], prefix: list[int]) -> float:
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt_ids + prefix])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def check_against_reference(target, prompt: str, token_ids: list[int], reference: list[int], ties: list) -> None:
    """Equal, or a continuation that first differs at a numerical tie (then the rest is not compared)."""
    common = next((index for index, (a, b) in enumerate(zip(token_ids, reference)) if a != b), None)
    if common is None:
        assert token_ids == reference[:len(token_ids)], f"{prompt!r}: {token_ids} vs {reference}"
        return
    margin = top2_margin(target, target.encode_prompt(prompt), reference[:common])
    assert margin < TIE_MARGIN, f"{prompt!r}: differs at {common} where the target's top-2 margin is {margin}"
    ties.append((prompt, common, margin))


@pytest.fixture(scope="module")
def engine(gemma, smollm):
    return Engine(gemma, smollm, batching=BatchingConfig(max_batch_size=3, prefill_chunk_tokens=8))


def test_a_continuous_batch_of_mixed_requests_equals_the_target_alone(engine, gemma):
    params = [SamplingParams(**sampling) for _, sampling, _ in REQUESTS]
    speculation = [SpeculationConfig(algorithm=algorithm, **options) for algorithm, _, options in REQUESTS]
    results = [None] * len(PROMPTS)
    # one decoder, 3 slots: requests join as others leave, prompts are prefilled in 8-token chunks meanwhile
    decoder = BatchDecoder(gemma, engine.drafter, engine.batching)
    requests = [engine.request(prompt, params[index], speculation=speculation[index], request_id=str(index))
                for index, prompt in enumerate(PROMPTS)]
    queue, pieces, sizes = list(requests), {index: [] for index in range(len(PROMPTS))}, set()
    while queue or len(decoder):
        while queue and len(decoder) < 3:
            decoder.add(queue.pop(0))
        sizes.add(len(decoder.running))
        for request, event in decoder.step():
            pieces[int(request.request_id)].extend(event.token_ids)
            if event.finish_reason:
                results[int(request.request_id)] = (pieces[int(request.request_id)], event)
    assert sizes >= {2, 3}, "requests must have decoded together"
    ties = []
    for index, prompt in enumerate(PROMPTS):
        token_ids, event = results[index]
        reference = reference_greedy(gemma, prompt, params[index].max_new_tokens)
        if params[index].stop:  # the stop string cuts the text; the reference runs to the budget
            assert event.finish_reason in ("stop", "length")
        check_against_reference(gemma, prompt, token_ids, reference, ties)
        assert event.stats.mean_batch_size > 1
    print(f"\nbatched greedy vs batch 1: {len(ties)} numerical ties in {len(PROMPTS)} requests: {ties}")
    assert len(ties) <= 1
    assert gemma.kv_pool.taken == set() and engine.drafter.kv_pool.taken == set()


def test_generate_batch_keeps_the_order_and_equals_generate(engine):
    params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=6, temperature=0.9, seed=4),
              SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, seed=1)]
    prompts = PROMPTS[:3]
    batched = engine.generate_batch(prompts, params, speculation={"algorithm": "slem"})
    alone = [engine.generate(prompt, p, speculation={"algorithm": "slem"}) for prompt, p in zip(prompts, params)]
    assert [result.token_ids for result in batched] == [result.token_ids for result in alone]
    assert [result.text for result in batched] == [result.text for result in alone]
    assert batched[0].stats.mean_batch_size > 1


def test_seeded_slem_in_a_batch_reproduces_the_target_alone_seed_for_seed(engine):
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed) for seed in range(4)]
    prompts = [PROMPTS[seed % 3] for seed in range(4)]
    slem = engine.generate_batch(prompts, params, speculation={"algorithm": "slem"})
    target_alone = engine.generate_batch(prompts, params, speculation={"algorithm": "ar"})
    assert [result.token_ids for result in slem] == [result.token_ids for result in target_alone]


def test_drafting_ahead_in_process_changes_speed_only(gemma, smollm):
    """Pipelined (hetspec/ahead.py, the drafter's next step on a second thread beside the verification): greedy and
    seeded SLEM equal the batch without it token for token, and drafts made ahead were used and dropped."""
    prompts = PROMPTS[:3]
    params = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=14)]
    batching = {"max_batch_size": 3, "prefill_chunk_tokens": 8}
    results = {pipelined: Engine(gemma, smollm, batching=BatchingConfig(**batching, pipelined=pipelined))
               .generate_batch(prompts, params, speculation={"algorithm": "slem", "draft_tokens": 3})
               for pipelined in (False, True)}
    assert [result.token_ids for result in results[True]] == [result.token_ids for result in results[False]]
    stats = [result.stats for result in results[True]]
    assert all(stat.pipelined for stat in stats) and not any(result.stats.pipelined for result in results[False])
    assert sum(stat.pipeline_hits for stat in stats) > 0 and sum(stat.pipeline_misses for stat in stats) > 0
    assert gemma.kv_pool.taken == set() and smollm.kv_pool.taken == set()


def test_a_bad_prompt_is_refused_before_any_work(engine, gemma):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate_batch(["fine", ""], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="params"):
        engine.generate_batch(["a", "b"], [SamplingParams()])
    assert gemma.kv_pool.taken == set()


def test_cancelling_mid_batch_frees_the_rows_at_once_and_leaves_the_others_unchanged(engine, gemma, smollm):
    params = SamplingParams(max_new_tokens=10)
    alone = [engine.generate(prompt, params, speculation={"algorithm": "slem"}).token_ids for prompt in PROMPTS[:3]]
    decoder = BatchDecoder(gemma, smollm, engine.batching)
    requests = [engine.request(prompt, params, speculation={"algorithm": "slem"}, request_id=str(index))
                for index, prompt in enumerate(PROMPTS[:3])]
    for request in requests:
        decoder.add(request)
    outputs = {index: [] for index in range(3)}
    for request, event in decoder.step() + decoder.step():
        outputs[int(request.request_id)].extend(event.token_ids)
    rows_before = len(gemma.kv_pool.taken)
    decoder.cancel(requests[1])
    assert len(gemma.kv_pool.taken) == rows_before - 1 and requests[1].target.session.row is None
    assert requests[1].drafter.session.row is None
    while len(decoder):
        for request, event in decoder.step():
            outputs[int(request.request_id)].extend(event.token_ids)
    assert outputs[0] == alone[0] and outputs[2] == alone[2]
    assert gemma.kv_pool.taken == set() and gemma.kv_pool.reserved_bytes == 0


def test_load_adaptive_draft_length_changes_speed_only(engine, gemma):
    speculation = SpeculationConfig(algorithm="slem", load_adaptive=True)
    params = SamplingParams(max_new_tokens=12)
    adaptive = engine.generate_batch(PROMPTS[:3], params, speculation=speculation)
    fixed = engine.generate_batch(PROMPTS[:3], params, speculation={"algorithm": "slem"})
    assert [result.token_ids for result in adaptive] == [result.token_ids for result in fixed]
    assert all(0 <= result.stats.mean_draft_length <= 5 for result in adaptive)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_ragged_passes_past_gemmas_sliding_window_equal_one_full_pass(gemma, packed):
    """Rows of different lengths (one past the 512-token window) and a token tree in one pass, either layout
    (hetspec/layouts.py), then a rollback: each row's logits equal a plain forward of that row's tokens alone."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 20000, (620,), generator=generator).tolist()
    with torch.inference_mode():
        full = gemma.model(input_ids=torch.tensor([ids])).logits[0].float()
        # the tree: ids[60] with two children, ids[61] (on the chain) and 7; then ids[62] under ids[61]
        branch = gemma.model(input_ids=torch.tensor([ids[:61] + [7]])).logits[0, -1].float()
    long, short, tree = gemma.new_session(), gemma.new_session(), gemma.new_session()
    try:
        long.extend(ids[:600], 1)
        short.extend(ids[:40], 1)
        tree.extend(ids[:60], 1)
        long_logits, short_logits, tree_logits = forward(
            gemma, [Feed(long, ids[600:605], 5), Feed(short, ids[40:41], 1),
                    Feed(tree, [ids[60], ids[61], 7, ids[62]], 4, parents=[-1, 0, 0, 1])], packed=packed)
        assert torch.allclose(long_logits, full[600:605], atol=2e-4)
        assert torch.allclose(short_logits, full[40:41], atol=2e-4)
        assert torch.allclose(tree_logits[[0, 1, 3]], full[60:63], atol=2e-4)
        assert torch.allclose(tree_logits[2], branch, atol=2e-4)
        long.rollback(602)
        assert torch.allclose(long.extend(ids[602:620], 2), full[618:620], atol=2e-4)
        assert long.nbytes == 620 * gemma.kv_pool.bytes_per_token
        tree.keep([*range(60), 60, 61, 63])  # the chain's path: the next pass reads its keys where they now are
        assert torch.allclose(forward(gemma, [Feed(tree, ids[63:64], 1), Feed(short, ids[41:45], 4)],
                                      packed=packed)[0], full[63:64], atol=2e-4)
    finally:
        long.release()
        short.release()
        tree.release()


def test_batched_sampling_equals_batch_one_seed_for_seed_on_synthetic_models():
    """Rejection sampling (SD, TLI, SLRS) and seeded SLEM: a request's numbers are its own, so a batch samples what
    batch 1 samples, seed for seed (tests/test_distribution.py and tests/test_exact_distribution.py check batch 1's
    distribution)."""
    target = language_model("target", target_tokenizer(), seed=0)
    drafters = {"sd": language_model("same-vocabulary drafter", target.tokenizer, seed=2),
                "tli": language_model("drafter", drafter_tokenizer(), seed=1)}
    drafters["slrs"] = drafters["slem"] = drafters["tli"]
    for algorithm, drafter in drafters.items():
        engine = Engine(target, drafter, batching=BatchingConfig(max_batch_size=8))
        params = [SamplingParams(max_new_tokens=5, temperature=0.8, top_k=5, seed=seed, ignore_eos=True)
                  for seed in range(24)]
        speculation = {"algorithm": algorithm, "draft_tokens": 3}
        batched = engine.generate_batch(["ab c"] * 24, params, speculation=speculation)
        alone = [engine.generate("ab c", p, speculation=speculation) for p in params]
        assert [result.token_ids for result in batched] == [result.token_ids for result in alone], algorithm
        assert batched[0].stats.mean_batch_size > 4


def _measured(policy: LoadAdaptive, rows: int, k: int, per_row: float, seconds: float, steps: int = 4) -> None:
    """``steps`` steps at ``rows`` requests (others than the tests choose for) and cap ``k``, each committing
    ``per_row`` tokens a row in ``seconds``."""
    for _ in range(steps):
        policy.record(k, {object(): per_row for _ in range(rows)}, seconds)


def test_load_adaptive_drafts_where_drafting_committed_more_a_second_and_not_where_less():
    """One client on the 2-core CPU (float32): a drafting step commits ~2.2 tokens in 0.42 s, a plain one 1 in 0.25 s;
    at 8 clients the drafting step widens 8 rows (1.7 s) against a plain pass of 0.45 s."""
    policy = LoadAdaptive()
    _measured(policy, 1, 5, 2.25, 0.42)
    _measured(policy, 1, 0, 1, 0.25)
    _measured(policy, 8, 5, 2.25, 1.7)
    _measured(policy, 8, 0, 1, 0.45)
    one, eight = {"a": 5}, {index: 5 for index in range(8)}
    per_row = (4 * 2.25 + 4 * 18 + PRIOR_ROWS * PRIOR_TOKENS) / (4 + 4 * 8 + PRIOR_ROWS)  # every batch size's, a prior
    assert policy.rate(1, True) == pytest.approx(per_row / 0.42) and policy.rate(8, False) == pytest.approx(8 / 0.45)
    assert policy.choose(one) == 5 and policy.choose(eight) == 0
    assert policy.choose({request: 0 for request in eight}) is None, "nobody drafts: nothing to choose"
    assert policy.chosen == [(1, 5), (8, 0)]


def test_a_near_tie_does_not_draft():
    """Drafting must beat plain decoding by DRAFT_MARGIN: at a tie, requests that draft finish apart and the batch
    runs underfull at its end."""
    policy = LoadAdaptive()
    _measured(policy, 8, 5, 2.0, 1.0, steps=60)  # 16 tokens a second drafting
    _measured(policy, 8, 0, 1.0, 0.5)  # 16 plain
    assert policy.choose({index: 5 for index in range(8)}) == 0
    _measured(policy, 8, 5, 2.0, 1.0 / (1 + 2 * DRAFT_MARGIN), steps=SECONDS_KEPT)
    assert policy.choose({index: 5 for index in range(8)}) == 5


def test_acceptance_measured_at_one_batch_size_prices_drafting_at_another():
    """Tokens committed a row come from every batch size (acceptance does not depend on the batch), seconds from
    the batch size's own steps: a batch size drafting rarely is priced with what the others accepted."""
    policy = LoadAdaptive()
    _measured(policy, 1, 5, 3.0, 0.4, steps=60)  # one client: long accepted runs
    _measured(policy, 4, 5, 1.0, 0.6, steps=2)  # four clients: two exploring steps with nothing accepted
    _measured(policy, 4, 0, 1.0, 0.3, steps=2)
    assert policy.rate(4, True) > policy.rate(4, False)
    assert policy.choose({index: 5 for index in range(4)}) == 5


def test_load_adaptive_times_each_choice_before_choosing():
    policy = LoadAdaptive()
    two = {"a": 5, "b": 3}
    choices = []
    for _ in range(2 * MIN_STEPS):
        choices.append(policy.choose(two))
        policy.record(choices[-1], {"a": 1, "b": 1}, 0.3)
    assert choices == [5, 0] * MIN_STEPS, "they alternate, drafting at the largest own k"


def test_a_batch_size_not_timed_is_priced_between_the_nearest_timed():
    """Timed again at each batch size, a batch finishing one request at a time probed drafting at 7, 6, ... rows."""
    policy = LoadAdaptive()
    _measured(policy, 1, 0, 1.0, 0.25)
    _measured(policy, 8, 0, 1.0, 0.45)
    _measured(policy, 8, 5, 1.0, 1.7)
    assert policy.step_seconds(4, False) == pytest.approx(0.25 + 0.2 * 3 / 7)
    assert policy.step_seconds(15, False) == pytest.approx(0.45 + 0.2), "the line through the two nearest, beyond"
    assert policy.step_seconds(3, True) == pytest.approx(1.7), "the only batch size timed drafting"
    assert policy.choose({index: 5 for index in range(7)}) == 0, "no probe at 7 rows"
    _measured(policy, 2, 0, 1.0, 0.30)
    assert policy.step_seconds(1, False) == pytest.approx(0.25)
    _measured(policy, 8, 0, 1.0, 0.20, steps=SECONDS_KEPT)  # noise: 8 rows timed faster than 2
    assert policy.step_seconds(16, False) == pytest.approx(0.20), "not falling with rows"


def test_load_adaptive_explores_less_while_its_choice_holds_and_often_again_once_it_moves():
    requests = {index: 5 for index in range(8)}
    policy = LoadAdaptive()
    _measured(policy, 8, 5, 1.0, 0.47)  # no draft pays (nothing accepted), but exploring costs little
    _measured(policy, 8, 0, 1.0, 0.45)
    choices = [policy.choose(requests) for _ in range(EXPLORE * 2 ** 6)]
    exploring = [step for step, k in enumerate(choices) if k]
    assert set(choices) == {0, 5}, "k = 0 chosen, the requests' own k = 5 on exploring steps"
    gaps = [later - earlier for earlier, later in zip(exploring, exploring[1:])]
    assert exploring[0] == EXPLORE - 1 and gaps[:4] == [2 * EXPLORE, 4 * EXPLORE, 8 * EXPLORE, 16 * EXPLORE]
    assert max(gaps) == EXPLORE_MAX, "the interval stops growing"
    _measured(policy, 8, 5, 1.5, 0.5, steps=SECONDS_KEPT)  # drafting became cheap (the batch moved onto a GPU)
    after = [policy.choose(requests) for _ in range(EXPLORE + 1)]
    assert after[0] == 5 and 0 in after, "the choice moved: the next exploring step within EXPLORE steps"


def _left(policy: LoadAdaptive, per_step: float) -> None:
    """A lone request drafts OWN_PRIOR_STEPS steps committing ``per_step`` tokens each, then leaves: its acceptance
    joins the last requests'."""
    for _ in range(OWN_PRIOR_STEPS):
        policy.record(5, {"gone": per_step}, 0.4)
    policy.choose({"someone else": 5})


@pytest.mark.parametrize("drafting_seconds, best_accepted, budget", [(1.7, 5.0, EXPLORE_BUDGET),
                                                                      (4.0, None, HOPELESS_BUDGET)])
def test_exploring_steps_take_at_most_their_budget_of_the_time(drafting_seconds, best_accepted, budget):
    """An exploring drafting round at 8 clients with its drafters' catch-up took ~1.7 s on the 2-core CPU against
    plain decoding's 0.44 (longer contexts: longer). On the schedule alone exploring steps of 4 s would take ~10%
    of the time here; they wait while what they took beyond a plain step exceeds EXPLORE_BUDGET of it, and
    HOPELESS_BUDGET where drafting would not pay even at the best acceptance lately seen (the prior's 2 tokens a
    step at 4 s: 4 tokens a second against plain decoding's 18; at 5 tokens a step and 1.7 s it would, 23.5)."""
    requests = {index: 5 for index in range(8)}
    policy = LoadAdaptive()
    if best_accepted:
        _left(policy, best_accepted)
    _measured(policy, 8, 5, 1.5, drafting_seconds)
    _measured(policy, 8, 0, 1.0, 0.45)
    choices = []
    for _ in range(1500):
        choices.append(policy.choose(requests))
        policy.record(choices[-1], dict.fromkeys(requests, 2 if choices[-1] else 1),
                      drafting_seconds if choices[-1] else 0.45)
    exploring = choices.count(5)
    elapsed = exploring * drafting_seconds + (len(choices) - exploring) * 0.45
    overspent = drafting_seconds - 0.45
    assert exploring >= 2 and exploring * overspent <= budget * elapsed + overspent
    if budget == EXPLORE_BUDGET:
        assert exploring * overspent > HOPELESS_BUDGET * elapsed + overspent, "a draft that could pay: the larger budget"


def test_the_exploring_budget_is_of_the_recent_time_not_of_a_quiet_stretch_before():
    """A replica that ran a lone request for ten minutes (exploring there nearly free) and then meets 8 clients must
    not spend ten minutes' budget at once: summed since the start, 5% of them let exploring drafting rounds of
    ~4 s (8 rows' drafters caught up, 6 tokens verified a row) come every time the schedule said, and a served level
    at 8 clients ran 8% below speculation off (docs/decisions/load-adaptive-draft-length.md). They take at
    most BUDGET_WINDOW_S seconds' worth of EXPLORE_BUDGET saved, EXPLORE_BUDGET of the time since, and one round."""
    policy = LoadAdaptive()
    _left(policy, 5.0)  # the best recent acceptance: drafting could pay at 8 rows, the larger budget applies
    _measured(policy, 1, 5, 2.2, 0.42)
    _measured(policy, 1, 0, 1, 0.25)
    lone = {"lone": 5}
    for _ in range(2400):  # ten minutes at one client, drafting settled (and exploring plain steps, cheaper)
        k = policy.choose(lone)
        policy.record(k, {"lone": 2.2 if k else 1}, 0.42 if k else 0.25)
    _measured(policy, 8, 5, 1.5, 4.0)
    _measured(policy, 8, 0, 1.0, 0.45)
    eight = {index: 5 for index in range(8)}
    spent = seconds = 0.0
    while seconds < 90:  # a level at 8 clients
        k = policy.choose(eight)
        step = 4.0 if k else 0.45
        policy.record(k, dict.fromkeys(eight, 1.5 if k else 1), step)
        seconds, spent = seconds + step, spent + (step - 0.45)
    assert spent <= EXPLORE_BUDGET * (BUDGET_WINDOW_S + seconds) + 4.0 - 0.45, "the window's budget and one round"


def test_no_exploring_step_while_a_prompt_is_being_fed():
    """A step that feeds a prompt is left out of the seconds: an exploring step there buys no measure (and, one model
    at a time in the server, its drafter catch-ups hold the pass that carries the prompt). It waits, retries too."""
    requests = {index: 5 for index in range(4)}
    policy = LoadAdaptive()
    _measured(policy, 4, 5, 1.0, 0.6)  # plain decoding settled; drafting could pay at the prior's 2 tokens a step
    _measured(policy, 4, 0, 1.0, 0.35)
    choices = [policy.choose(requests) for _ in range(EXPLORE - 1)]
    assert choices == [0] * (EXPLORE - 1) and policy.since_explore == EXPLORE - 1
    feeding = {**requests, "joining": None}
    assert [policy.choose(feeding) for _ in range(EXPLORE)] == [0] * EXPLORE, "due, but a prompt is being fed"
    assert policy.chosen[-1] == (5, 0), "the joining request counts as a row"
    assert policy.choose(requests) == 5, "explored once the prompt is in"
    policy.record(5, dict.fromkeys(requests, 2), 0.9, priced=False)
    assert policy.choose(feeding) == 0 and policy.retry is not None
    assert policy.choose(requests) == 5 and policy.retry is None


def test_an_exploring_step_left_out_of_the_seconds_is_taken_again_once():
    """In the server the first drafting round after a plain stretch catches the drafter's context up and is left out
    of the seconds: exploring must time a drafting step after it, or drafting stays priced by its first probes."""
    policy = LoadAdaptive()
    _measured(policy, 1, 5, 1.2, 0.42)
    _measured(policy, 1, 0, 1.0, 0.25)
    lone = {"a": 5}
    choices = []
    for _ in range(3 * EXPLORE):
        choices.append(policy.choose(lone))
        drafting = choices[-1] > 0  # each drafting step catches the drafter up: left out of the seconds
        policy.record(choices[-1], {"a": 2 if drafting else 1}, 0.9 if drafting else 0.25, priced=not drafting)
    first = choices.index(5)
    assert choices[first:first + 3] == [5, 5, 0], "taken again once, not again after the retry was left out"
    policy.choose(lone)
    seconds = len(policy.seconds[1, True])
    for _ in range(200):  # exploring steps now measured, once the budget allows (0.65 s spent on each above)
        choice = policy.choose(lone)
        policy.record(choice, {"a": 2 if choice else 1}, 0.42 if choice else 0.25)
        assert choice == 0 or policy.retry is None
    assert len(policy.seconds[1, True]) > seconds
    assert policy.step_seconds(1, True) == pytest.approx(0.42)


def test_a_lone_request_drafts_on_its_own_acceptance_not_on_the_request_before():
    """One client on the 2-core CPU: the request before accepted little (1.56 tokens a drafting step: drafting a
    near-tie with plain decoding, under the margin); the next request is tried within EXPLORE steps of joining and,
    accepting 3 tokens a drafting step, drafts from then on. Where drafting cannot pay even at the best acceptance
    lately seen (8 rows), a request joining brings no exploring step: at 8 rows it costs every drafter a catch-up."""
    policy = LoadAdaptive()
    before = {"before": 5}
    policy.choose(before)
    _measured(policy, 1, 5, 1.56, 0.42, steps=60)
    _measured(policy, 1, 0, 1.0, 0.25, steps=SECONDS_KEPT)
    choices = [policy.choose(before) for _ in range(40)]
    assert choices[-10:] == [0] * 10, "it does not draft"
    newcomer = {"newcomer": 5}
    choices = []
    for _ in range(EXPLORE + 4):
        choices.append(policy.choose(newcomer))
        policy.record(choices[-1], {"newcomer": 3 if choices[-1] else 1}, 0.42 if choices[-1] else 0.25)
    tried = choices.index(5)
    assert tried < EXPLORE and choices[tried + 1:].count(0) <= 1, "drafting but for an exploring step"
    pooled = policy.rate(1, True) * 0.42  # the pooled figure: the request before's 60 steps dominate it
    tokens, steps = policy.own["newcomer"]
    assert policy.rate(1, True, newcomer) * 0.42 == pytest.approx(
        (tokens + OWN_PRIOR_STEPS * pooled) / (steps + OWN_PRIOR_STEPS)) and tokens == 3 * steps

    batch = {index: 5 for index in range(8)}
    _measured(policy, 8, 5, 1.5, 1.7)
    _measured(policy, 8, 0, 1.0, 0.45)
    policy.choose(batch)
    policy.explore_every = interval = EXPLORE_MAX  # as after a long stretch of plain decoding
    del batch[0]
    batch["joined"] = 5
    policy.choose(batch)
    assert policy.explore_every == interval, "at 3 tokens a drafting step it would not pay"
    assert list(policy.accepted) == [3.0] and set(policy.own) <= set(batch), "a request's tally goes with it"


def test_a_step_that_feeds_a_prompt_prices_nothing(engine):
    """A request that starts at once feeds the target its prompt in its first step and the drafter its own at its
    first draft (the second step: the first token is the target's own): measured as a step of 1 + k tokens, such a
    step read as dear and held a lone request at k = 0."""
    decoder = engine.decoder(load_adaptive=True)
    request = engine.request(PROMPTS[2], {"max_new_tokens": 8},
                             speculation={"algorithm": "slem", "load_adaptive": True})
    decoder.add(request)
    try:
        decoder.step()
        assert request.position == 1 and decoder.adaptive.chosen == [] and decoder.adaptive.seconds == {}
        decoder.step()
        [(_, first_k)] = decoder.adaptive.chosen
        assert first_k > 0 and decoder.adaptive.seconds == {}, "the first draft fed the drafter's prompt"
        second = request.position
        decoder.step()
        [_, (rows, k)] = decoder.adaptive.chosen
        [[seconds]] = decoder.adaptive.seconds.values()
        assert decoder.adaptive.seconds == {(1, k > 0): decoder.adaptive.seconds[1, k > 0]} and seconds > 0
        # both drafting steps' tokens count (what the request accepted), the third's seconds alone
        assert (request.position - second, 1) in decoder.adaptive.committed[k > 0]
        assert (second - 1, 1) in decoder.adaptive.committed[True]
    finally:
        decoder.cancel(request)  # its KV rows: the models are shared by the whole session's tests
    assert engine.target.kv_pool.taken == set() and engine.drafter.kv_pool.taken == set()


def _greedy(model, prompt_ids: list[int], new_tokens: int, fail_after: int | None = None):
    """A computation: prefill in chunks of 8, then greedy tokens one pass each; its generated ids."""
    session = model.new_session()
    try:
        yield from prefill(session, prompt_ids, 8)
        ids = list(prompt_ids)
        for step in range(new_tokens):
            if step == fail_after:
                raise RuntimeError("this request fails")
            logits = yield Feed(session, ids[session.length:], 1)  # [1, vocab]
            ids.append(int(logits[0].argmax()))
        return ids[len(prompt_ids):]
    finally:
        session.release()


class _CheckedRows(set):
    """A pool's taken rows that call ``on_check`` at each check of how many there are (after counting them)."""

    def __init__(self, rows, on_check):
        super().__init__(rows)
        self.on_check = on_check

    def __len__(self) -> int:
        count = super().__len__()
        self.on_check()
        return count


def test_a_request_opening_as_the_last_one_closes_keeps_its_rows_buffers():
    """The pool frees its buffers when its last row is given back; a request that takes a row right after that
    check (here: while the free holds the pool) must find buffers for its pass, not an IndexError."""
    model = language_model("target", target_tokenizer(), seed=0)
    pool = model.kv_pool
    closing, opening = model.new_session(), model.new_session()
    closing.extend([1, 2, 3])
    errors: list[BaseException] = []
    opener: list[threading.Thread] = []

    def extend_opening() -> None:
        try:
            opening.extend([4, 5])
        except BaseException as error:  # noqa: BLE001 - the assertion below reports it
            errors.append(error)

    def another_request_opens() -> None:
        if pool.guard._exclusive and not opener:  # the free's check: the closing request holds the pool
            opener.append(threading.Thread(target=extend_opening))
            opener[0].start()
            opener[0].join(timeout=0.5)  # it runs to its pass, or waits for the free to finish

    pool.taken = _CheckedRows(pool.taken, another_request_opens)
    closing.release()
    opener[0].join(timeout=30)
    assert not errors and opening.length == 2 and pool.rows > opening.row
    opening.release()
    assert pool.taken == set() and pool.reserved_bytes == 0


def test_shared_passes_batch_calls_from_many_threads_and_equal_each_alone():
    """What a served worker does (deployments/workers/model_workers.py): calls from many threads share passes, joining
    at the next pass; each gets what it gets alone; a long prompt's chunks join the others' passes, one chunk a pass
    (packed); one failing computation fails alone."""
    model = language_model("target", target_tokenizer(), seed=0)
    prompts = [[index % 4] * (3 + 7 * index) for index in range(10)]  # 3 to 66 tokens: some above LONG_ABOVE_TOKENS
    alone = [run_alone(model, _greedy(model, prompt, 6)) for prompt in prompts]
    shared = SharedPasses(model)
    results: dict[int, object] = {}

    def call(index: int) -> None:
        try:
            results[index] = shared.run(_greedy(model, prompts[index % 10], 6, 2 if index == 10 else None))
        except RuntimeError as error:
            results[index] = error

    threads = [threading.Thread(target=call, args=(index,)) for index in range(11)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [results[index] for index in range(10)] == alone
    assert isinstance(results[10], RuntimeError)
    own_passes = sum(6 + -(-(len(prompt) - 1) // 8) for prompt in prompts)
    assert shared.passes < own_passes and shared.rows > shared.passes  # passes were shared
    assert model.kv_pool.taken == set() and model.kv_pool.reserved_bytes == 0  # every row back, memory freed


def test_long_prompts_are_prefilled_first_come_first_served_between_the_others_passes():
    """Each round feeds the short feeds and the first-come long one: a prompt's chunks all run before the next
    prompt's first, while a decoding request gets a pass every round."""
    model = language_model("target", target_tokenizer(), seed=0)
    fed: list[str] = []  # who got logits, in pass order

    def prompt(name: str, length: int) -> Steps:
        session = model.new_session()
        try:
            while session.length < length:
                yield Feed(session, [1] * min(40, length - session.length), 1)  # 40 > LONG_ABOVE_TOKENS
                fed.append(name)
        finally:
            session.release()

    def decode(name: str, passes: int) -> Steps:
        session = model.new_session()
        try:
            for _ in range(passes):
                yield Feed(session, [2], 1)
                fed.append(name)
        finally:
            session.release()

    run_lockstep(model, [prompt("a", 120), prompt("b", 80), decode("d", 5)])
    long_passes = [name for name in fed if name != "d"]
    assert long_passes == ["a", "a", "a", "b", "b"], fed  # first come first served, one chunk a pass
    assert fed[:2] == ["d", "a"] and fed.count("d") == 5 and fed.index("b") > fed.index("d", 2)


@pytest.mark.parametrize("load_adaptive", [False, True])
def test_a_joining_prompt_rides_the_others_verification_passes_in_chunks(load_adaptive):
    """In process too, a joining request's prompt chunks join the running request's passes (one target pass a
    step, not a chunk pass besides), the drafter's likewise, and both requests get what they get alone. The
    load-adaptive cap is chosen meanwhile at 2 rows: the load the batch has."""
    target = language_model("target", target_tokenizer(), seed=0)
    drafter = language_model("drafter", drafter_tokenizer(), seed=1)
    engine = Engine(target, drafter, batching=BatchingConfig(max_batch_size=2, prefill_chunk_tokens=8))
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True), SamplingParams(max_new_tokens=8, ignore_eos=True)]
    prompts = ["ab c", "abc ab cab ca bc a b c abc cba"]
    speculation = SpeculationConfig(algorithm="slem", load_adaptive=load_adaptive)
    assert len(target.encode_prompt(prompts[1])) > 2 * 8 and len(drafter.encode_prompt(prompts[1])) > 2 * 8
    alone = [engine.generate(prompt, own, speculation=speculation).token_ids for prompt, own in zip(prompts, params)]
    target_passes = []
    forward = target.model.forward
    target.model.forward = lambda *args, **kwargs: target_passes.append(1) or forward(*args, **kwargs)
    try:
        decoder = BatchDecoder(target, drafter, engine.batching, load_adaptive=load_adaptive)
        requests = [engine.request(prompt, params[index], speculation=speculation, request_id=str(index))
                    for index, prompt in enumerate(prompts)]
        generated: dict[str, list[int]] = {"0": [], "1": []}
        passes_while_joining = []
        decoder.add(requests[0])
        waiting = [requests[1]]  # joins once the first decodes
        while len(decoder):
            if generated["0"] and waiting:
                decoder.add(waiting.pop())
            joining = bool(decoder.joining) and bool(decoder.running)  # (with nobody running, they start at once)
            before, chosen = len(target_passes), len(decoder.adaptive.chosen) if load_adaptive else 0
            for request, event in decoder.step():
                generated[request.request_id] += event.token_ids
            if joining:
                passes_while_joining.append(len(target_passes) - before)
                if load_adaptive:
                    assert [rows for rows, _ in decoder.adaptive.chosen[chosen:]] in ([], [2])
    finally:
        del target.model.forward
    assert [generated["0"], generated["1"]] == alone
    assert len(passes_while_joining) >= 3, "the prompt went in chunks of 8 while the first request decoded"
    assert set(passes_while_joining) == {1}, "each chunk rode the running request's verification pass"
    assert target.kv_pool.taken == set() and drafter.kv_pool.taken == set()


def test_unseeded_sampling_draws_a_fresh_seed_that_reproduces_the_sample():
    """No seed: every request draws its own (reported in its statistics); that seed gives the same sample again."""
    engine = Engine(language_model("target", target_tokenizer(), seed=0))
    params = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    results = [engine.generate("ab c", params) for _ in range(20)]
    seeds = [result.stats.seed for result in results]
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2**63 for seed in seeds)
    assert len({tuple(result.token_ids) for result in results}) > 1
    for result in results[:3]:
        again = engine.generate("ab c", params.model_copy(update={"seed": result.stats.seed}))
        assert again.token_ids == result.token_ids and again.stats.seed == result.stats.seed
    batched = engine.generate_batch(["ab c"] * 2, params)
    assert batched[0].stats.seed != batched[1].stats.seed


def test_auto_with_a_seed_samples_the_targets_own_seeded_sample_at_any_draft_length_and_batch():
    """A client's seed makes ``auto`` run exact matching (SLEM): the sample is seeded ``ar``'s whatever the draft
    length, the drafter's luck or the batch; without a seed auto runs TLI, and greedy SLEM as before."""
    target = language_model("target", target_tokenizer(), seed=0)
    engine = Engine(target, language_model("drafter", drafter_tokenizer(), seed=1),
                    batching=BatchingConfig(max_batch_size=8))
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=seed, ignore_eos=True) for seed in range(6)]
    target_alone = [engine.generate("ab c", p, speculation={"algorithm": "ar"}).token_ids for p in params]
    for draft_tokens in (1, 2, 5):
        speculation = {"algorithm": "auto", "draft_tokens": draft_tokens}
        alone = [engine.generate("ab c", p, speculation=speculation) for p in params]
        assert {result.stats.algorithm for result in alone} == {"slem"}
        assert [result.token_ids for result in alone] == target_alone, draft_tokens
        batched = engine.generate_batch(["ab c", "b"] * 3 + ["ab c"] * 6, [params[0]] * 6 + params,
                                        speculation=speculation)
        assert [result.token_ids for result in batched[6:]] == target_alone, draft_tokens
    unseeded = engine.generate("ab c", SamplingParams(max_new_tokens=4, temperature=0.9))
    assert unseeded.stats.algorithm == "tli"
    assert engine.generate("ab c", SamplingParams(max_new_tokens=4)).stats.algorithm == "slem"


def test_the_first_token_is_the_targets_own_and_drafting_starts_at_the_second():
    """As served (the drafter's prompt is fed at its first draft there), so both runtimes draft alike and a seeded
    sample is the same in process and served."""
    target = language_model("target", target_tokenizer(), seed=0)
    drafter = language_model("drafter", drafter_tokenizer(), seed=1)
    engine = Engine(target, drafter)
    request = engine.request("ab c", SamplingParams(max_new_tokens=8, ignore_eos=True),
                             speculation=SpeculationConfig(algorithm="slem", draft_tokens=3))
    decoder = BatchDecoder(target, drafter, engine.batching)
    decoder.add(request)
    try:
        decoder.step()
        assert request.position == 1 and request.stats.chosen_draft_tokens == 0
        decoder.step()
        assert request.stats.chosen_draft_tokens == 3
    finally:
        decoder.cancel(request)
