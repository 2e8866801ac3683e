"""Losslessness on real models with different tokenizers (float32): token ids identical to the target alone."""

import pytest
import torch

from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.algorithms import ALGORITHM_CLASSES, Draft
from hetspec.decoder import TargetSide
from hetspec.passes import run_alone

pytestmark = pytest.mark.real

PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n",
    "La capitale de la France est une ville qui",
    "東京は日本の首都で、",
    "Party time 🎉🥳! Here are five emoji and why",
    "   Leading spaces, then numbers: 3.14159, 2.71828,",
    "SELECT name, COUNT(*) FROM users WHERE",
    "Q: What is 17 * 23?\nA:",
]
NEW_TOKENS = 64


def _ar_reference(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    return engine.generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids


# The draft length policies change speed only; each direction runs a different one so both are covered.
DIRECTIONS = {
    "gemma<-smollm": SpeculationConfig(draft_tokens=4, adaptive=True),
    "smollm<-gemma": SpeculationConfig(draft_tokens=4, adaptive=True, confidence_threshold=0.3),
}
VARIANTS = {"slem": {"algorithm": "slem"}, "slem-tree3": {"algorithm": "slem", "tree_width": 3},
            "tli": {"algorithm": "tli"}, "slrs": {"algorithm": "slrs"}}


def _variants(prompt_index: int, every: bool) -> list[str]:
    """Every variant, or (the default run) SLEM and one other, taking turns: each variant still meets several
    prompts of each kind, at 40% less time than the full matrix (the slow run's)."""
    if every:
        return list(VARIANTS)
    others = [name for name in VARIANTS if name != "slem"]
    return ["slem", others[prompt_index % len(others)]]


# The reverse direction and the full matrix of variants double the longest default test; they run with the
# slow tests (-m slow).
@pytest.mark.parametrize("direction, every", [
    ("gemma<-smollm", False), pytest.param("gemma<-smollm", True, marks=pytest.mark.slow),
    pytest.param("smollm<-gemma", True, marks=pytest.mark.slow)])
def test_greedy_identical_to_target_alone(gemma, smollm, direction, every):
    target, drafter = (gemma, smollm) if direction == "gemma<-smollm" else (smollm, gemma)
    engine = Engine(target, drafter)
    speculation = DIRECTIONS[direction]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    accepted_per_pass = {}
    for index, prompt in enumerate(PROMPTS):
        reference = _ar_reference(engine, prompt, params)
        assert len(reference) == NEW_TOKENS
        for name in _variants(index, every):
            update = VARIANTS[name]
            result = engine.generate(prompt, params, speculation=speculation.model_copy(update=update))
            assert result.token_ids == reference, (direction, name, prompt)
            accepted_per_pass.setdefault(name, []).append(result.stats.mean_accepted_per_pass)
    print(direction, {name: round(sum(values) / len(values), 2) for name, values in accepted_per_pass.items()})


@pytest.mark.parametrize("seed, tree_width", [(3, 1), (11, 3)])
def test_seeded_slem_sampling_reproduces_target_sampling(gemma, smollm, seed, tree_width):
    engine = Engine(gemma, smollm)
    for prompt in PROMPTS[:2]:
        params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        reference = _ar_reference(engine, prompt, params)
        result = engine.generate(prompt, params, speculation=SpeculationConfig(algorithm="slem", tree_width=tree_width))
        assert result.token_ids == reference
        assert result.stats.accepted_tokens > 0  # the drafter did contribute, it was not a silent fallback


def test_seeds_change_sampled_output(gemma):
    engine = Engine(gemma)
    outputs = {tuple(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed)).token_ids)
               for seed in range(4)}
    assert len(outputs) > 1


# TLI is left out here: Gemma's vocabulary holds tokens with the same bytes (e.g. "\n" and <0x0A>), and the
# byte-level intersection proposes the lowest such id, which the target may not choose. Lossless all the same;
# tests/test_distribution.py checks TLI's full acceptance on vocabularies without duplicates.
@pytest.mark.parametrize("algorithm", ["slem", "sd"])
def test_drafter_identical_to_target_accepts_every_draft(gemma, algorithm):
    engine = Engine(gemma, gemma)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    reference = _ar_reference(engine, PROMPTS[0], params)
    result = engine.generate(PROMPTS[0], params, speculation=SpeculationConfig(algorithm=algorithm, draft_tokens=4))
    assert result.token_ids == reference
    assert result.stats.drafted_tokens > 0
    assert result.stats.accepted_tokens == result.stats.drafted_tokens


def test_rollback_leaves_exactly_the_accepted_prefix(gemma):
    """After a rejection the cache must equal a fresh prefill of the committed ids, past Gemma's 512-token window."""
    prompt_ids = gemma.encode_prompt("All work and no play makes Jack a dull boy. " * 60)[:600]
    side = TargetSide(gemma, prompt_ids)
    exact_match = ALGORITHM_CLASSES["slem"](None, SpeculationConfig())
    fresh_session = gemma.new_session()
    try:
        greedy = run_alone(gemma, side.verify(exact_match, Draft(), SamplingParams()))[0]
        wrong = [(greedy + 1) % gemma.vocab_size, 7, 8, 9]
        committed = list(side.ids)
        new_ids = run_alone(gemma, side.verify(exact_match, Draft(candidates=wrong), SamplingParams()))
        assert len(new_ids) == 1, "rejected at the first candidate"
        assert side.session.length == len(side.ids) - 1 == len(committed)
        next_logits = side.session.extend(side.ids[-1:], logits_to_keep=1)[-1]
        fresh = fresh_session.extend(side.ids, logits_to_keep=1)[-1]
        assert torch.allclose(next_logits, fresh, atol=2e-4)
        assert int(next_logits.argmax()) == int(fresh.argmax())
    finally:  # the session-wide model's rows back for the tests after this one
        side.release()
        fresh_session.release()


def test_hugging_face_assisted_generation_agrees(gemma, smollm):
    """The peer: transformers' universal assisted generation gives the same greedy tokens on the same pair."""
    engine = Engine(gemma, smollm)
    for prompt in PROMPTS[:2]:
        ours = engine.generate(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True),
                               speculation=SpeculationConfig(algorithm="slem"))
        input_ids = torch.tensor([gemma.encode_prompt(prompt)])
        with torch.inference_mode():
            peer = gemma.model.generate(input_ids, assistant_model=smollm.model, tokenizer=gemma.tokenizer,
                                        assistant_tokenizer=smollm.tokenizer, do_sample=False, max_new_tokens=32,
                                        min_new_tokens=32, attention_mask=torch.ones_like(input_ids))
        assert peer[0, input_ids.shape[1]:].tolist() == ours.token_ids


def test_int8_drafter_changes_speed_never_the_output(gemma):
    from hetspec import load_model

    drafter = load_model("smollm2-135m", quantize="int8")
    assert type(drafter.model.lm_head).__name__ == "Linear" and "quantized" in type(drafter.model.lm_head).__module__
    engine = Engine(gemma, drafter)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = _ar_reference(engine, PROMPTS[1], params)
    result = engine.generate(PROMPTS[1], params, speculation=SpeculationConfig(algorithm="slem", draft_tokens=4))
    assert result.token_ids == reference and result.stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="CPU only"):
        load_model("smollm2-135m", quantize="int8", device="cuda")


class _DrafterWanting:
    """A drafter side whose every next token is ``token_id`` (the parts of DrafterSide a draft uses)."""

    def __init__(self, token_id: int, vocab_size: int):
        self.token_id, self.vocab_size, self.forwards, self.pushed = token_id, vocab_size, 0, []
        self.context = self

    def sync(self, committed: bytes) -> None:
        pass

    def push(self, token_id: int) -> None:
        self.pushed.append(token_id)

    def next_logits(self):  # a generator like DrafterSide.next_logits, that needs no pass
        import torch

        self.forwards += 1
        return torch.full((self.vocab_size,), -10.0).index_fill_(0, torch.tensor([self.token_id]), 10.0)
        yield


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "sampling"])
def test_a_drafted_eos_ends_the_draft_as_its_last_candidate(smollm, params):
    """Found by the same-vocabulary benchmark: SD crashed when the drafter proposed EOS (no bytes to spell)."""
    from hetspec.algorithms import PairMaps, make_algorithm

    maps = PairMaps(smollm, smollm)
    eos = min(smollm.eos_token_ids)
    assert maps.target_table[eos] is None
    # SD's map is the identity, EOS included (TLI's byte intersection leaves EOS out: it never proposes it)
    algorithm = make_algorithm("sd", maps, SpeculationConfig(algorithm="sd", draft_tokens=4), params)
    drafter = _DrafterWanting(eos, smollm.vocab_size)
    draft = run_alone(smollm, algorithm.draft(drafter, b"Hello", 4, params, 0, 0))
    assert draft.candidates == [eos] and drafter.pushed == [] and drafter.forwards == 1
    assert (draft.draft_probs is None) == params.greedy
