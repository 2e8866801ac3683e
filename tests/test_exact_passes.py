"""Bit-exact passes (hetspec/exact.py): a position's logits do not depend on what shares its pass.

``exact_attention`` on hand-built tensors: every query of a chunk, a padded batch, a packed pass and a tree gets
the bits of a lone query over exactly its keys, whatever masks and key counts surround it. Then on the real
target in bfloat16 (``real``): each pass layout against one-position passes (``torch.equal`` of every position's
logits), the self-check, and greedy output token for token against transformers' own ``generate`` of the target
alone, every algorithm, alone and batched, no tie exceptions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetspec.exact import LAYOUTS, NoLoneRowLinear, compare_layouts, exact_attention, linear_rows_invariant, query_keys

DTYPE = torch.bfloat16
MIN = torch.finfo(DTYPE).min


def _lone(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seen: list[int]) -> torch.Tensor:
    """One query ([heads, head_dim]) alone over the keys ``seen`` ([kv_heads, keys, head_dim]): a one-position pass."""
    index = torch.tensor(seen)
    return F.scaled_dot_product_attention(query[None, :, None], key[None][:, :, index], value[None][:, :, index],
                                          scale=0.125, enable_gqa=True)[0, :, 0]


def _check(query, key, value, visible: torch.Tensor) -> None:
    """query: [batch, heads, queries, dim]; key/value: [batch, kv_heads, keys, dim]; visible [batch, queries, keys]."""
    additive = torch.zeros(visible.shape, dtype=DTYPE).masked_fill_(~visible, MIN)[:, None]
    for mask in (additive, visible[:, None]):
        output = exact_attention(None, query, key, value, mask, scaling=0.125)[0]  # [batch, queries, heads, dim]
        for row in range(visible.shape[0]):
            for index in range(visible.shape[1]):
                seen = visible[row, index].nonzero()[:, 0].tolist()
                assert torch.equal(output[row, index], _lone(query[row, :, index], key[row], value[row], seen)), \
                    (row, index)


@pytest.fixture
def tensors():
    generator = torch.Generator().manual_seed(0)

    def make(batch: int, queries: int, keys: int):
        shape = lambda heads, count: (batch, heads, count, 64)  # noqa: E731
        return [torch.randn(shape(heads, count), generator=generator).to(DTYPE)
                for heads, count in ((4, queries), (2, keys), (2, keys))]
    return make


def test_a_chunk_of_queries_each_gets_its_lone_bits_past_a_kernel_block(tensors):
    """A prompt's chunk of 40 queries after 1,000 cached keys (the flash kernel and eager's matmuls reduce over
    such key counts in blocks that depend on the query count), reading 30 masked keys past the last query."""
    query, key, value = tensors(1, 40, 1070)
    positions = torch.arange(1000, 1040)[:, None]
    _check(query, key, value, (torch.arange(1070)[None] <= positions)[None])


def test_padded_rows_of_other_lengths_each_get_their_lone_bits(tensors):
    query, key, value = tensors(3, 4, 90)
    lengths = torch.tensor([10, 85, 40])  # row b's 4 queries at slots length_b..length_b + 3
    slots = lengths[:, None] + torch.arange(4)[None]  # [batch, queries]
    _check(query, key, value, torch.arange(90)[None, None] <= slots[:, :, None])


def test_packed_rows_each_get_their_lone_bits(tensors):
    """Two rows' keys one after another in one sequence (the packed layout): the second row's keys start at 37."""
    query, key, value = tensors(1, 5, 60)
    row_of_key = (torch.arange(60) >= 37).long()
    slot_of_key = torch.where(row_of_key == 0, torch.arange(60), torch.arange(60) - 37)
    rows, slots = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([35, 36, 20, 21, 22])
    visible = (row_of_key[None] == rows[:, None]) & (slot_of_key[None] <= slots[:, None])
    _check(query, key, value, visible[None])


def test_tree_nodes_get_the_bits_of_their_path_alone(tensors):
    """Nodes 0..4 after 300 cached keys, parents [-1, -1, 0, 2, 1]: node 3 sees 0..299, 300, 302 and itself only."""
    query, key, value = tensors(1, 5, 305)
    parents = [-1, -1, 0, 2, 1]
    visible = torch.zeros(5, 305, dtype=torch.bool)
    visible[:, :300] = True
    for node, parent in enumerate(parents):
        visible[node, 300 + node] = True
        if parent >= 0:
            visible[node] |= visible[parent]
    _check(query, key, value, visible[None])
    assert isinstance(query_keys(visible[None, None], 1, 5, 305)[0][3], torch.Tensor)  # a gather, not a slice


@pytest.mark.parametrize("bias", [True, False])
def test_a_lone_row_gets_the_bits_it_gets_among_other_rows(bias):
    """Qwen2.5-1.5B's q-projection shape, where a lone bfloat16 row takes a matrix-vector kernel of other bits on
    this project's CPU: through ``NoLoneRowLinear`` it gets its bits among 2, 8 and 64 rows, anywhere among them."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(1536, 1536, bias=bias).to(DTYPE)
    torch.nn.init.normal_(linear.weight, std=0.02, generator=generator)
    if not linear_rows_invariant(linear):
        pytest.skip("this CPU's bfloat16 Linear gives a row other bits among other row counts: no fix applies")
    wrapped = NoLoneRowLinear(linear)
    row = torch.randn(1, 1, 1536, generator=generator).to(DTYPE)  # [batch, positions, features]
    alone = wrapped(row)[0, 0]
    for count in (2, 8, 64):
        others = torch.randn(1, count, 1536, generator=generator).to(DTYPE)
        others[0, count // 3] = row[0, 0]
        assert torch.equal(wrapped(others)[0, count // 3], alone), count


def test_sliding_window_queries_see_a_slice():
    visible = (torch.arange(30)[None] <= torch.arange(26, 30)[:, None]) & \
        (torch.arange(30)[None] > torch.arange(26, 30)[:, None] - 8)
    assert query_keys(visible[None, None], 1, 4, 30) == [[(19, 27), (20, 28), (21, 29), (22, 30)]]


def test_a_bias_in_the_mask_is_refused():
    with pytest.raises(ValueError, match="biases"):
        query_keys(torch.full((1, 1, 2, 3), 0.5), 1, 2, 3)


def test_a_query_that_sees_no_key_gets_zeros_and_the_others_their_lone_bits(tensors):
    """Transformers' left-padded batch (its batched generate, the benchmarks' peer) has padding positions that see
    no key: their output is discarded, so zeros, never an error."""
    query, key, value = tensors(2, 3, 6)
    visible = torch.arange(6)[None, None] <= torch.tensor([[3, 4, 5], [3, 4, 5]])[:, :, None]
    visible[1, 0] = False  # row 1's first query is a padding position
    output = exact_attention(None, query, key, value, visible[:, None], scaling=0.125)[0]
    assert not output[1, 0].any()
    for row, index in ((0, 0), (0, 2), (1, 1), (1, 2)):
        seen = visible[row, index].nonzero()[:, 0].tolist()
        assert torch.equal(output[row, index], _lone(query[row, :, index], key[row], value[row], seen))


# ---- the real target in bfloat16 ----

PROMPTS = [
    "def is_prime(n):\n",
    "The three primary colours are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "東京は日本の首都で、",
]
NEW_TOKENS = 12
# every algorithm, chain and tree, with and without the context lookup (a drafter identical to the target for sd)
SPECULATIONS = [
    {"algorithm": "ar"},
    {"algorithm": "sd", "draft_tokens": 3},
    {"algorithm": "slem", "draft_tokens": 4},
    {"algorithm": "slem", "draft_tokens": 3, "tree_width": 3},
    {"algorithm": "slem", "draft_tokens": 3, "lookup": "always"},
    {"algorithm": "tli", "draft_tokens": 3},
    {"algorithm": "slrs", "draft_tokens": 2},
]


@pytest.fixture(scope="module")
def exact_target():
    from hetspec.models import load_model

    return load_model("gemma3-270m", dtype="bfloat16", bit_exact=True)


@pytest.fixture(scope="module")
def layouts(exact_target):
    return compare_layouts(exact_target, length=24)


@pytest.mark.real
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_pass_layout_gives_every_position_its_one_position_bits_in_bfloat16(layouts, layout):
    assert layouts[layout]


@pytest.mark.real
def test_the_self_check_says_bit_exact_for_the_exact_bfloat16_target(exact_target):
    assert exact_target.bit_exact is True


def _generate_reference(target, prompt: str) -> list[int]:
    """transformers' own greedy generate of the target alone (batch 1, its prompt in one pass)."""
    prompt_ids = target.encode_prompt(prompt)
    with torch.inference_mode():
        output = target.model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=sorted(target.eos_token_ids), pad_token_id=0)
    return output[0, len(prompt_ids):].tolist()


@pytest.mark.real
@pytest.mark.timeout(900)
def test_greedy_output_is_transformers_generate_token_for_token_in_bfloat16(exact_target):
    """No tie exceptions: every algorithm, alone and in a batch (with the prompts fed in chunks of 4), equals
    transformers' ``generate`` of the target alone in bfloat16, which runs the same (exact) attention."""
    from hetspec import Engine, SamplingParams
    from hetspec.config import BatchingConfig
    from hetspec.models import load_model

    assert exact_target.bit_exact
    drafter = load_model("smollm2-135m", dtype="bfloat16")
    engines = {"sd": Engine(exact_target, exact_target, batching=BatchingConfig(prefill_chunk_tokens=4)),
               "other": Engine(exact_target, drafter, batching=BatchingConfig(prefill_chunk_tokens=4))}
    expected = [_generate_reference(exact_target, prompt) for prompt in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for speculation in SPECULATIONS:
        engine = engines["sd" if speculation["algorithm"] == "sd" else "other"]
        alone = [engine.generate(prompt, params, speculation=speculation).token_ids for prompt in PROMPTS]
        assert alone == expected, speculation
        batched = engine.generate_batch(PROMPTS, params, speculation=speculation)
        assert [result.token_ids for result in batched] == expected, speculation
