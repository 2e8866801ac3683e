"""Token trees: the trie, the exact-match walk, tree attention and the KV cache kept after a tree pass."""

from __future__ import annotations

import pytest
import torch

from synthetic import language_model, target_tokenizer
from hetspec import SamplingParams, SpeculationConfig
from hetspec.algorithms import ALGORITHM_CLASSES, Draft
from hetspec.decoder import TargetSide
from hetspec.passes import run_alone
from hetspec.tree import ROOT, chain_then_tree, trie, walk


def test_trie_shares_prefixes_and_keeps_order():
    tree = trie([[5, 6, 7], [5, 6, 8], [9], [5, 6, 7, 1]])
    assert tree.tokens == [5, 6, 7, 8, 9, 1]
    assert tree.parents == [ROOT, 0, 1, 1, ROOT, 2]
    assert tree.depths() == [1, 2, 3, 3, 1, 4]
    assert tree.max_depth == 4
    assert tree.children() == {ROOT: {5: 0, 9: 4}, 0: {6: 1}, 1: {7: 2, 8: 3}, 2: {1: 5}}
    assert tree.path(5) == [0, 1, 2, 5]
    assert trie([]).tokens == [] and trie([[]]).max_depth == 0


def test_walk_follows_the_target_choices_down_one_branch():
    tree = trie([[5, 6, 7], [5, 6, 8], [9]])
    choices = {ROOT: 5, 0: 6, 1: 8, 3: 4}  # the target's own token after each node
    seen_depths = []

    def choice_at(node, depth):
        seen_depths.append(depth)
        return choices[node]

    accepted, next_token = walk(tree.children(), choice_at)
    assert [tree.tokens[node] for node in accepted] == [5, 6, 8] and next_token == 4
    assert seen_depths == [0, 1, 2, 3]
    assert walk(tree.children(), lambda node, depth: 2) == ([], 2)  # nothing matches: the target's own token


def test_chain_then_tree_hangs_the_tree_off_the_last_fed_token():
    tree = trie([[5, 6], [7]])
    assert chain_then_tree(2, tree) == [-1, 0, 1, 2, 1]
    assert chain_then_tree(1, tree) == [-1, 0, 1, 0]


@pytest.fixture(scope="module")
def tiny():
    return language_model("tiny", target_tokenizer(), seed=0)


def test_a_tree_pass_gives_each_branch_the_logits_of_that_branch_alone(tiny):
    prefix = [0, 1, 2, 3, 1]
    tree = trie([[4, 5, 6], [4, 7], [2]])
    session = tiny.new_session()
    session.extend(prefix[:-1])
    logits = session.extend_tree([prefix[-1]] + tree.tokens, chain_then_tree(1, tree))  # [1 + nodes, vocab]
    for leaf in (2, 3, 4):
        branch = [tree.tokens[node] for node in tree.path(leaf)]
        alone = tiny.new_session().extend(prefix + branch)[-len(branch) - 1:]
        rows = [0] + [node + 1 for node in tree.path(leaf)]
        assert torch.allclose(logits[rows], alone, atol=1e-5)


def test_keep_leaves_the_cache_of_one_branch(tiny):
    prefix = [0, 1, 2, 3]
    tree = trie([[4, 5, 6], [4, 7]])
    session = tiny.new_session()
    session.extend(prefix[:-1])
    session.extend_tree([prefix[-1]] + tree.tokens, chain_then_tree(1, tree))
    branch = tree.path(3)  # tokens 4, 7
    session.keep(list(range(len(prefix))) + [len(prefix) + node for node in branch])
    assert session.length == len(prefix) + 2
    after = session.extend([1])[-1]
    fresh = tiny.new_session().extend(prefix + [4, 7, 1])[-1]
    assert torch.allclose(after, fresh, atol=1e-5)
    with pytest.raises(ValueError):
        session.keep([2, 1])


def test_tree_width_is_for_exact_match_algorithms_only():
    assert SpeculationConfig(algorithm="slem", tree_width=3).tree_width == 3
    for algorithm in ("tli", "slrs", "sd"):
        with pytest.raises(ValueError, match="tree_width"):
            SpeculationConfig(algorithm=algorithm, tree_width=2)


def test_target_tree_verification_past_gemmas_sliding_window(gemma):
    """A tree verified at a 700-token context (Gemma's sliding layers see 512) accepts the target's own
    greedy branch and leaves the cache equal to a fresh prefill of the committed ids."""
    prompt_ids = gemma.encode_prompt("All work and no play makes Jack a dull boy. " * 70)[:700]
    reference, fresh, side = gemma.new_session(), gemma.new_session(), TargetSide(gemma, prompt_ids)
    try:
        greedy = []
        logits = reference.extend(prompt_ids, logits_to_keep=1)
        for _ in range(4):
            greedy.append(int(logits[-1].argmax()))
            logits = reference.extend(greedy[-1:], logits_to_keep=1)
        side.session.extend(prompt_ids[:-1], logits_to_keep=1)  # the invariant: all but the last committed id cached
        wrong = (greedy[1] + 1) % gemma.vocab_size
        tree = trie([[greedy[0], wrong, 5], greedy[:3], [greedy[0], greedy[1], 9]])
        new_ids = run_alone(gemma, side.verify(ALGORITHM_CLASSES["slem"](None, SpeculationConfig()), Draft(tree=tree),
                                               SamplingParams()))
        assert new_ids == greedy
        assert side.session.length == len(side.ids) - 1
        next_logits = side.session.extend(side.ids[-1:], logits_to_keep=1)[-1]
        fresh_logits = fresh.extend(side.ids, logits_to_keep=1)[-1]
        assert torch.allclose(next_logits, fresh_logits, atol=2e-4)
    finally:  # the session-wide model's rows back for the tests after this one
        for session in (reference, fresh, side.session):
            session.release()


@pytest.mark.parametrize("pipelined", [False, True])
def test_served_decode_loop_with_a_draft_tree_equals_the_target_alone(exit_stack, gemma, smollm, pipelined):
    """The Serve coordinator's loop on worker objects in this process (the actors run the same classes):
    tree drafts travel drafter -> alignment -> target and the output is the target's alone."""
    import asyncio

    from deployments.serving.request import GenerationRequest
    from hetspec import Engine
    from serve_fixtures import in_process_coordinator

    coordinator, target_worker, drafter_worker = exit_stack.enter_context(in_process_coordinator(
        gemma, smollm, speculation={"algorithm": "slem", "draft_tokens": 4, "tree_width": 3}))
    prompt, params = "def fibonacci(n):\n", SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = Engine(gemma).generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
    request = GenerationRequest(prompt=prompt, params=params, pipelined=pipelined)

    async def run():
        events = [event async for event in coordinator.run(coordinator.prepare(request), "tree")]
        await coordinator.admission.closes_done()  # closes are fire and forget: the loop must outlive them
        return events

    taken_before = (set(gemma.kv_pool.taken), set(smollm.kv_pool.taken))  # the session-wide models' other users
    events = asyncio.run(run())
    assert [token for event in events for token in event.token_ids] == reference
    assert events[-1].stats.accepted_tokens > 0
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0
    assert (gemma.kv_pool.taken, smollm.kv_pool.taken) == taken_before, "the request's KV rows were freed"
