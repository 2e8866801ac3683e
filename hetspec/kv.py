"""One KV cache per model, shared by its requests: each request holds a row, batched passes feed many rows.

Layout: per layer a preallocated keys and a values buffer [rows, kv_heads, capacity, head_dim]. A request
(``KVSession``) owns one row and a length: its tokens sit in slots 0..length-1 of that row, in order, so
slot = position. Rollback to the accepted prefix only lowers the length (nothing is copied); a token
tree's accepted path is compacted inside the row (``keep``). A batched pass (``forward``) feeds a ragged
set of rows: row b's n_b new tokens are written at slots length_b.., each query attends to its row's
slots through an explicit mask, so different lengths, candidate counts and trees share one pass. The
pass is laid out padded (rows of equal width; the keys read in place) or packed (one sequence, no
padding; the keys gathered), whichever costs less: hetspec/layouts.py.

Why not transformers' ``DynamicCache`` per request (what this replaced): a batched pass needs one tensor
over all rows, so per-request caches would be stacked (copied) every step, and ``DynamicCache`` itself
concatenates (copies) the whole cache on every update. Why not transformers' paged continuous-batching
cache: it is tied to its own scheduler and attention kernels and has no rollback of rejected tokens.

Sliding-window layers (Gemma 3) keep every slot too: the mask hides keys ``sliding_window`` or more
positions behind the query, as the model's own mask does, so a rollback is possible at any length.
The price is memory that grows with the context instead of being capped at the window.

Capacity (slots per row) and rows grow by doubling (one copy, amortized); the buffers are freed when the
last session closes. Memory per token: ``bytes_per_token``; per request: ``KVSession.nbytes``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Sequence

import torch
from transformers import DynamicCache

from hetspec import layouts

if TYPE_CHECKING:
    from hetspec.models import LanguageModel


class _SharedExclusive:
    """Many passes at once (they write disjoint rows), or one resize alone."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                self._shared -= 1
                self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive and self._shared == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class KVPool:
    """The buffers of one model and which rows are taken."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        config = model.config.get_text_config()
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = model.get_input_embeddings().weight.dtype  # int8-quantized models keep float32 activations
        self.device = device
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.capacity = 0
        self.taken: set[int] = set()
        self.guard = _SharedExclusive()
        self._rows_lock = threading.Lock()

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element

    @property
    def reserved_bytes(self) -> int:
        return self.rows * self.capacity * self.bytes_per_token

    def take_row(self) -> int:
        with self._rows_lock:
            row = next(index for index in range(len(self.taken) + 1) if index not in self.taken)
            self.taken.add(row)
        self.reserve(row + 1, self.capacity)
        return row

    def give_row(self, row: int) -> None:
        with self._rows_lock:
            self.taken.discard(row)
            empty = not self.taken
        if empty:
            # the check and the free under the rows lock too: a row taken between them (a request opening as the
            # last one closes) found the buffers still there (``reserve`` returned at once), then lost them, and
            # its pass failed with an IndexError
            with self.guard.exclusive(), self._rows_lock:
                if not self.taken:  # nobody took a row meanwhile: free the memory
                    self.keys, self.values, self.rows, self.capacity = [], [], 0, 0

    @torch.inference_mode()
    def reserve(self, rows: int, capacity: int) -> None:
        """At least ``rows`` rows of ``capacity`` slots; growth doubles and copies the used buffers once."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        with self.guard.exclusive():
            new_rows = max(self.rows, rows if rows <= self.rows else max(rows, 2 * self.rows))
            new_capacity = max(self.capacity, capacity if capacity <= self.capacity else max(capacity, 2 * self.capacity, 64))
            if new_rows == self.rows and new_capacity == self.capacity:
                return
            shape = (new_rows, self.kv_heads, new_capacity, self.head_dim)
            for buffers in (self.keys, self.values):
                old = list(buffers) or [None] * self.layers
                buffers.clear()
                for previous in old:
                    grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    if previous is not None:
                        grown[:previous.shape[0], :, :previous.shape[2]] = previous
                    buffers.append(grown)
            self.rows, self.capacity = new_rows, new_capacity


@dataclass
class Feed:
    """Tokens to feed after a session's cached ones and how many of their logits to return.

    ``parents`` makes the tokens a tree (``hetspec.tree``: index of each token's parent among these tokens,
    -1 for the cache's last token); None feeds a chain. Row i of the logits predicts the token after
    ``token_ids[len(token_ids) - logits_to_keep + i]``.
    """

    session: "KVSession"
    token_ids: list[int]
    logits_to_keep: int = 1
    parents: list[int] | None = None


class KVSession:
    """One request's cache on one model: a row of the model's ``KVPool``; ``length`` tokens are cached."""

    def __init__(self, language_model: "LanguageModel"):
        self.language_model = language_model
        self.row: int | None = None
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this request's tokens hold."""
        return self.length * self.language_model.kv_pool.bytes_per_token

    def extend(self, token_ids: list[int], logits_to_keep: int | None = None) -> torch.Tensor:
        """Feed ``token_ids`` after the cached ones (a pass of this row alone).  -> [kept, vocab] float32"""
        kept = len(token_ids) if logits_to_keep is None else logits_to_keep
        return forward(self.language_model, [Feed(self, list(token_ids), kept)])[0]

    def extend_tree(self, token_ids: list[int], parents: list[int], logits_to_keep: int | None = None) -> torch.Tensor:
        """Feed a token tree (``Feed.parents``); its slots stay in feeding order until ``keep``.  -> [kept, vocab]"""
        if len(parents) != len(token_ids):
            raise ValueError("extend_tree needs one parent per token")
        kept = len(token_ids) if logits_to_keep is None else logits_to_keep
        return forward(self.language_model, [Feed(self, list(token_ids), kept, list(parents))])[0]

    @torch.inference_mode()
    def keep(self, positions: list[int]) -> None:
        """Keep only the cached tokens at ``positions`` (increasing), in that order: one path of a fed tree."""
        if any(b <= a for a, b in zip(positions, positions[1:])) or (positions and positions[-1] >= self.length):
            raise ValueError(f"positions to keep must increase and lie below {self.length}")
        start = next((index for index, position in enumerate(positions) if position != index), len(positions))
        if start < len(positions):  # move only the tail that changes place, inside this row
            pool = self.language_model.kv_pool
            index = torch.tensor(positions[start:], dtype=torch.long, device=pool.device)
            with pool.guard.shared():
                for buffer in pool.keys + pool.values:
                    buffer[self.row, :, start:len(positions)] = buffer[self.row].index_select(1, index)
        self.length = len(positions)

    def rollback(self, length: int) -> None:
        """Drop every cached token after the first ``length`` (a rejected draft's keys and values)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length

    @torch.inference_mode()
    def copy_to_dynamic_cache(self) -> DynamicCache:
        """This row's cached tokens as a transformers ``DynamicCache`` of batch 1 (a copy), for passes that
        branch the context many ways at once (SLRS's lookahead enumeration)."""
        pool = self.language_model.kv_pool
        cache = DynamicCache()
        with pool.guard.shared():
            for layer in range(pool.layers):
                cache.update(pool.keys[layer][self.row:self.row + 1, :, :self.length].clone(),
                             pool.values[layer][self.row:self.row + 1, :, :self.length].clone(), layer)
        return cache

    def release(self) -> None:
        if self.row is not None:
            self.language_model.kv_pool.give_row(self.row)
        self.row, self.length = None, 0


# A padded pass of more than this many times the feeds' real tokens is run packed (hetspec/layouts.py): the
# gather that packing costs is small beside linear layers computing that much padding.
PACK_ABOVE_PADDING = 1.5


@torch.inference_mode()
def forward(language_model: "LanguageModel", feeds: list[Feed], packed: bool | None = None) -> list[torch.Tensor]:
    """One batched pass over the feeds' sessions (distinct) of ``language_model``; ``packed``: the layout
    (hetspec/layouts.py), None picks packed where padding would cost more than ``PACK_ABOVE_PADDING`` times
    the real tokens. Returns per feed its float32 logits  # [logits_to_keep, vocab]
    """
    if not feeds or any(not feed.token_ids for feed in feeds):
        raise ValueError("every feed needs at least one token")
    if len({id(feed.session) for feed in feeds}) != len(feeds):
        raise ValueError("a pass feeds each session at most once")
    pool = language_model.kv_pool
    for feed in feeds:
        if feed.session.row is None:
            feed.session.row = pool.take_row()
    order = sorted(range(len(feeds)), key=lambda index: feeds[index].session.row)  # contiguous rows read as a view
    feeds = [feeds[index] for index in order]
    counts = [len(feed.token_ids) for feed in feeds]
    if packed is None:
        packed = len(feeds) * max(counts) > PACK_ABOVE_PADDING * sum(counts)
    pool.reserve(max(feed.session.row for feed in feeds) + 1,
                 max(feed.session.length for feed in feeds) + max(counts))
    layout = (layouts.packed if packed else layouts.padded)(pool, feeds)
    device = pool.device
    kept = layout.logits_to_keep if isinstance(layout.logits_to_keep, int) else layout.logits_to_keep.to(device)
    lean = language_model.lean
    # the lean forward needs no mask where every query sees every key (a request alone, one token)
    masks = None if lean is not None and layout.visible.all() else layouts.attention_masks(pool, layout)
    with pool.guard.shared():
        if lean is not None:
            logits = lean(input_ids=layout.input_ids.to(device), position_ids=layout.query_positions.to(device),
                          attention_mask=masks and masks["full_attention"], cache=layout.cache, logits_to_keep=kept)
        else:
            logits = language_model.model(
                input_ids=layout.input_ids.to(device), cache=layout.cache, use_cache=True,
                position_ids=layout.query_positions.to(device),
                attention_mask=masks if pool.layer_types else masks["full_attention"], logits_to_keep=kept).logits
    # logits: [batch, kept, vocab]
    results: list[torch.Tensor] = [None] * len(feeds)  # type: ignore[list-item]
    for (b, rows), feed, index in zip(layout.kept, feeds, order):
        feed.session.length += len(feed.token_ids)
        results[index] = logits[b, rows].float()
    return results


@dataclass
class PassRecord:
    """One batched pass, as ``_Lockstep`` reports it (its ``on_pass``)."""

    rows: int  # feeds
    prompt_chunk: bool  # a feed above LONG_ABOVE_TOKENS (a prompt's chunk) was in it


# A computation that needs model passes: it yields a Feed, gets back that feed's logits, and returns its result.
Steps = Generator[Feed, torch.Tensor, Any]


# A feed longer than this is a prompt's chunk: at most one joins a pass (a token budget per pass).
LONG_ABOVE_TOKENS = 32


class _Lockstep:
    """Computations in lockstep: ``advance`` starts or resumes one, ``run_pass`` feeds every waiting one in
    one batched pass. A computation that raises fails alone; a pass that raises fails the ones it fed."""

    def __init__(self, language_model: "LanguageModel",
                 on_pass: Callable[[PassRecord], None] = lambda record: None) -> None:
        self.language_model = language_model
        self.on_pass = on_pass  # called after each pass
        self.waiting: dict[Any, tuple[Steps, Feed]] = {}  # by key: the computation and the feed it waits on
        self.passes = 0
        self.rows = 0  # feeds over all passes
        self.last_rows = 0  # feeds of the latest pass: what a computation resumed by it was batched with

    def advance(self, key: Any, computation: Steps, logits: torch.Tensor | None,
                done: Callable[[Any, Any, BaseException | None], None]) -> None:
        try:
            self.waiting[key] = (computation, computation.send(logits))
        except StopIteration as finished:
            self.waiting.pop(key, None)
            done(key, finished.value, None)
        except Exception as error:
            self.waiting.pop(key, None)
            done(key, None, error)

    def run_pass(self, done: Callable[[Any, Any, BaseException | None], None]) -> None:
        """Feed the waiting computations in one pass: every short feed and the long feed (a prompt's chunk) of
        the computation that came first; the pass is packed when the widths differ (``forward``), so the chunk
        widens no other row. One long feed a pass, first come first served: the first prompt is done (and its
        request decodes) before the next starts, instead of every prompt finishing in the last round, and
        the others' decoding goes on in every pass."""
        # dict order is arrival order: a computation keeps its place while it waits again
        short = [key for key in self.waiting if len(self.waiting[key][1].token_ids) <= LONG_ABOVE_TOKENS]
        first_long = next((key for key in self.waiting if len(self.waiting[key][1].token_ids) > LONG_ABOVE_TOKENS),
                          None)
        keys = short + ([first_long] if first_long is not None else [])
        feeds = [self.waiting[key][1] for key in keys]
        self.passes += 1
        self.rows += len(keys)
        try:
            all_logits = forward(self.language_model, feeds)
        except Exception as error:
            for key in keys:
                self.waiting.pop(key)[0].close()
                done(key, None, error)
            return
        self.on_pass(PassRecord(len(feeds), first_long is not None))
        self.last_rows = len(feeds)
        for key, logits in zip(keys, all_logits):
            self.advance(key, self.waiting[key][0], logits, done)


def run_lockstep(language_model: "LanguageModel", computations: Sequence[Steps]) -> list[Any]:
    """Run several requests' computations with one batched pass per round: every computation that waits for
    logits is fed in the same pass (a draft of k tokens costs k passes for all requests together)."""
    results: list[Any] = [None] * len(computations)
    errors: list[BaseException] = []

    def done(index: int, result: Any, error: BaseException | None) -> None:
        results[index] = result
        if error is not None:
            errors.append(error)

    lockstep = _Lockstep(language_model)
    for index, computation in enumerate(computations):
        lockstep.advance(index, computation, None, done)
    while lockstep.waiting and not errors:
        lockstep.run_pass(done)
    for computation, _ in lockstep.waiting.values():
        computation.close()
    if errors:
        raise errors[0]
    return results


class SharedPasses:
    """One model's passes shared by computations that arrive from many threads (a served model's calls).

    A computation submitted while a pass runs joins the next pass: each pass feeds every computation waiting
    for logits at that moment, so concurrent requests cost one pass per round, not one each. The thread that
    finds nobody driving drives until nothing waits; ``execute`` runs each round (the worker puts it on its
    model thread); the others wait for their result. A computation that raises fails alone.
    """

    def __init__(self, language_model: "LanguageModel",
                 execute: Callable[..., Any] = lambda work, *args: work(*args),
                 on_pass: Callable[[PassRecord], None] = lambda record: None) -> None:
        self.execute = execute
        self._lockstep = _Lockstep(language_model, on_pass)
        self._guard = threading.Lock()
        self._arrived: list[tuple[Future, Steps]] = []
        self._driving = False

    @property
    def passes(self) -> int:
        """Batched passes run so far."""
        return self._lockstep.passes

    @property
    def rows(self) -> int:
        """Feeds over all passes (rows / passes: the mean batch of a pass)."""
        return self._lockstep.rows

    @property
    def last_rows(self) -> int:
        """Feeds of the latest pass: read by a computation right after its last feed, the batch it rode."""
        return self._lockstep.last_rows

    def run(self, computation: Steps) -> Any:
        """The computation's result, its passes shared with whatever else runs meanwhile."""
        outcome = self.run_many([computation])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def run_many(self, computations: Sequence[Steps]) -> list[Any]:
        """Each computation's result, or the exception it raised; all of them start in the same pass."""
        results = [Future() for _ in computations]
        with self._guard:
            self._arrived.extend(zip(results, computations))
            drive, self._driving = not self._driving, True
        try:
            if drive:
                self._drive()
            wait(results)
        except BaseException:  # interrupted: the computations still use the caller's sessions, so wait for them
            wait(results)
            raise
        return [result.exception() or result.result() for result in results]

    def _drive(self) -> None:
        arrived: list[tuple[Future, Steps]] = []
        try:
            while True:
                with self._guard:
                    arrived, self._arrived = self._arrived, []
                    if not arrived and not self._lockstep.waiting:
                        self._driving = False
                        return
                self.execute(self._round, arrived)
                arrived = []
        except BaseException as error:  # the rounds cannot go on (their thread failed): nobody waits forever
            with self._guard:
                arrived, self._arrived = arrived + self._arrived, []
                self._driving = False
            for result, computation in [*arrived, *((key, waiting[0]) for key, waiting in
                                                    list(self._lockstep.waiting.items()))]:
                computation.close()
                if not result.done():
                    result.set_exception(error)
            self._lockstep.waiting.clear()
            raise

    def _round(self, arrived: list[tuple[Future, Steps]]) -> None:
        for result, computation in arrived:
            self._lockstep.advance(result, computation, None, _settle)
        if self._lockstep.waiting:
            self._lockstep.run_pass(_settle)


def _settle(result: Future, value: Any, error: BaseException | None) -> None:
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(value)


def prefill(session: KVSession, ids: Sequence[int], chunk_tokens: int, leave: int = 1,
            chunks: int | None = None) -> Steps:
    """Feed ``ids`` but the last ``leave`` (the next draft or verification feeds them) in chunks of
    ``chunk_tokens``, one pass each: a joining prompt then delays the others' passes by one chunk at a time.
    ``chunks``: at most this many (None: until only ``leave`` are left); returns the tokens still to feed."""
    fed = 0
    while session.length < len(ids) - leave and (chunks is None or fed < chunks):
        yield Feed(session, list(ids[session.length:len(ids) - leave][:chunk_tokens]), 1)
        fed += 1
    return max(len(ids) - leave - session.length, 0)


def run_alone(language_model: "LanguageModel", computation: Steps) -> Any:
    """One request's computation, one pass per feed (a batch of one)."""
    return run_lockstep(language_model, [computation])[0]
