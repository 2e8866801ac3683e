"""Token trees: several drafts verified in one target pass with tree attention.

A chain draft proposes one continuation; a tree proposes several that share their prefixes (SpecInfer,
Miao et al. 2024; the beam of EAGLE-2, Li et al. 2024). Fed after the cache with a mask that lets each
node see the cache and its own ancestors only, one forward pass yields the logits after every node.
Under exact-match verification (SLEM; any algorithm under greedy) the target walks down from the root
taking its own choice at each node, so the output is the target's own whatever the tree holds: a tree
changes speed, never the output.

Nodes are numbered in the order they are fed; a parent always comes before its children.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

ROOT = -1  # the parent of a first-level node: the last token already cached or fed before the tree


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index of each node's parent, or ROOT

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        """1 for a first-level node."""
        found: list[int] = []
        for parent in self.parents:
            found.append(1 if parent == ROOT else found[parent] + 1)
        return found

    @property
    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self) -> dict[int, dict[int, int]]:
        """parent (or ROOT) -> {token id: child index}."""
        found: dict[int, dict[int, int]] = {}
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            found.setdefault(parent, {})[token] = node
        return found

    def path(self, node: int) -> list[int]:
        """Node indices from the first level down to ``node``."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def trie(sequences: Iterable[Sequence[int]]) -> TokenTree:
    """The prefix tree of token sequences: a shared prefix is one set of nodes."""
    tree = TokenTree()
    children: dict[int, dict[int, int]] = {}
    for sequence in sequences:
        node = ROOT
        for token in sequence:
            child = children.setdefault(node, {}).get(token)
            if child is None:
                child = tree.add(token, node)
                children[node][token] = child
            node = child
    return tree


def chain_then_tree(prefix_len: int, tree: TokenTree) -> list[int]:
    """Parents of ``prefix_len`` tokens fed as a chain, followed by ``tree`` hanging off the last of them."""
    chain = [index - 1 for index in range(prefix_len)]
    return chain + [prefix_len - 1 if parent == ROOT else prefix_len + parent for parent in tree.parents]


def walk(children: dict[int, dict[int, int]], choice_at: Callable[[int, int], int]) -> tuple[list[int], int]:
    """Exact-match verification of a tree (Timor et al. 2025, Alg. 2, one branch at a time).

    ``choice_at(node, depth)`` is the target's own token after ``node`` (ROOT: after the committed text)
    at output offset ``depth``. Returns (the accepted nodes, root to leaf; the target's choice after them).
    """
    node, accepted = ROOT, []
    while True:
        token = choice_at(node, len(accepted))
        child = children.get(node, {}).get(token)
        if child is None:
            return accepted, token
        accepted.append(child)
        node = child
