"""llama.cpp as a peer: the very GGUF file hetspec loads, decoded by llama.cpp (``llama-cpp-python``).

The peer a CPU user would pick. hetspec converts a GGUF target to a transformers model (weights dequantized
to the run's dtype); llama.cpp reads the quantized blocks as they are (Q4_K_M: ~4.8 bits a weight), so on a
memory-bound CPU it moves a third of the bytes a bfloat16 pass does. It decodes the target alone (its own
speculative decoding needs one vocabulary). ``llama-cpp-python`` is an optional benchmark dependency
(``pip install -e ".[bench-llama]"``; benchmarks/README.md says how to build it once): without it the
benchmarks skip this peer and say so.

A run feeds llama.cpp the same prompt token ids as the other methods (the GGUF's vocabulary is the target's),
greedy (top-k 1), and stops at the target's end-of-sequence tokens or after ``max_new_tokens``; its wall
clock includes the prefill, as every method's does. No forward hooks reach inside llama.cpp, so its rows
have tokens/s and speedup over the target alone, not tokens per pass.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.analysis import first_difference, geometric_mean

NAME = "llama.cpp"
INSTALL_HINT = ("llama-cpp-python is not installed: the llama.cpp peer is skipped. Install it with "
                "`pip install -e \".[bench-llama]\"` (it compiles llama.cpp; benchmarks/README.md, \"llama.cpp\").")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_of(target_spec: str) -> Path:
    """The GGUF file behind a target: a registry short name's cached file, or a ``.gguf`` path."""
    from hetspec import registry

    if target_spec in registry.OFFLINE_MODELS:
        return registry.resolve(target_spec)
    if target_spec.endswith(".gguf") and Path(target_spec).is_file():
        return Path(target_spec)
    raise ValueError(f"llama.cpp needs the target as a GGUF file; {target_spec!r} is neither a short name "
                     f"({', '.join(sorted(registry.OFFLINE_MODELS))}) nor a .gguf file")


@dataclass
class PeerRun:
    prompt_id: str
    method: str
    token_ids: list[int]
    seconds: float  # wall clock of the whole call, prefill included


class LlamaCppPeer:
    """llama.cpp decoding the target's GGUF greedily, one request at a time."""

    name = NAME

    def __init__(self, gguf: Path, threads: int, eos_token_ids: set[int], context: int = 8192):
        from llama_cpp import Llama

        self.gguf = Path(gguf)
        self.threads = threads
        self.eos_token_ids = set(eos_token_ids)
        self.llm = Llama(model_path=str(self.gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        self.eos_token_ids.add(self.llm.token_eos())

    def settings(self) -> dict:
        import llama_cpp

        return {"gguf": self.gguf.name, "threads": self.threads, "llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        self.llm.reset()  # no prefix reuse from the previous call: every run pays its own prefill
        token_ids: list[int] = []
        if max_new_tokens <= 0:
            return token_ids
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in self.eos_token_ids:
                break
            token_ids.append(token)
            if len(token_ids) >= max_new_tokens:
                break
        return token_ids

    def run(self, prompt_id: str, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        started = time.perf_counter()
        token_ids = self.generate(prompt_ids, max_new_tokens)
        return PeerRun(prompt_id, self.name, token_ids, time.perf_counter() - started)


class LlamaCppBatch:
    """llama.cpp decoding several sequences greedily in one batch (what ``llama-server -np N`` and
    ``llama-batched-bench`` do): every step one ``llama_decode`` of each running sequence's next token; prompts
    prefilled together first. The served benchmark's peer at N clients: llama.cpp's throughput for N requests at once,
    without a server's costs."""

    name = NAME + " batched"

    def __init__(self, peer: LlamaCppPeer, sequences: int, context_per_sequence: int):
        import llama_cpp

        self.peer, self.sequences = peer, sequences
        self.context_per_sequence = context_per_sequence
        # the single-sequence peer's settings (flash attention, cache types, threads, batch), more sequences
        params = llama_cpp.llama_context_params.from_buffer_copy(peer.llm.context_params)
        params.n_ctx = sequences * context_per_sequence
        params.n_seq_max = sequences
        self.model = peer.llm._model.model
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        if not self.context:
            raise RuntimeError(f"llama.cpp could not make a context for {sequences} sequences")
        self.batch = llama_cpp.llama_batch_init(512, 0, sequences)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def close(self) -> None:
        import llama_cpp

        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.context)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most 512."""
        import llama_cpp

        self.batch.n_tokens = len(entries)
        for index, (token, position, sequence, logits) in enumerate(entries):
            self.batch.token[index], self.batch.pos[index] = token, position
            self.batch.seq_id[index][0], self.batch.n_seq_id[index] = sequence, 1
            self.batch.logits[index] = logits
        if llama_cpp.llama_decode(self.context, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        import llama_cpp
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(self.context, index)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def generate(self, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Each prompt's greedy continuation, up to EOS or ``max_new_tokens``; at most ``sequences`` prompts."""
        import llama_cpp

        if len(prompts_ids) > self.sequences or any(
                len(ids) + max_new_tokens > self.context_per_sequence for ids in prompts_ids):
            raise ValueError("more prompts or tokens than this batch context holds")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.context), True)
        prompt_entries = [(token, position, sequence, position == len(ids) - 1)
                          for sequence, ids in enumerate(prompts_ids) for position, token in enumerate(ids)]
        next_tokens: dict[int, int] = {}
        for start in range(0, len(prompt_entries), 512):
            chunk = prompt_entries[start:start + 512]
            self._decode(chunk)
            next_tokens.update({entry[2]: self._argmax(index) for index, entry in enumerate(chunk) if entry[3]})
        outputs: list[list[int]] = [[] for _ in prompts_ids]
        running = []
        for sequence in range(len(prompts_ids)):
            if next_tokens[sequence] not in self.peer.eos_token_ids and max_new_tokens > 0:
                outputs[sequence].append(next_tokens[sequence])
                running.append(sequence)
        while running:
            running = [sequence for sequence in running if len(outputs[sequence]) < max_new_tokens]
            if not running:
                break
            self._decode([(outputs[sequence][-1], len(prompts_ids[sequence]) + len(outputs[sequence]) - 1, sequence,
                           True) for sequence in running])
            still = []
            for index, sequence in enumerate(running):
                token = self._argmax(index)
                if token not in self.peer.eos_token_ids:
                    outputs[sequence].append(token)
                    still.append(sequence)
            running = still
        return outputs


def summarize_peer(runs: list[PeerRun], reference: dict[str, tuple[list[int], float]]) -> dict:
    """One summary row for a peer: tokens/s over all prompts, per-prompt speedup over ``ar`` (``reference``:
    prompt id -> ar's token ids and seconds), and on how many prompts its tokens equal ar's."""
    tokens = sum(len(run.token_ids) for run in runs)
    seconds = sum(run.seconds for run in runs)
    speedups, same = [], 0
    for run in runs:
        ar_ids, ar_seconds = reference[run.prompt_id]
        if run.token_ids and ar_ids:
            speedups.append((len(run.token_ids) / run.seconds) / (len(ar_ids) / ar_seconds))
        same += first_difference(ar_ids, run.token_ids) is None
    return {"method": runs[0].method, "prompts": len(runs), "tokens": tokens,
            "tokens_per_second": tokens / seconds if seconds else None,
            "ms_per_token": 1000 * seconds / tokens if tokens else None,
            "speedup_vs_ar_median": statistics.median(speedups) if speedups else None,
            "speedup_vs_ar_geomean": geometric_mean(speedups), "prompts_same_as_ar": same}
