"""SD: standard speculative decoding (Leviathan et al. 2023), for a drafter with the target's vocabulary.

With identical vocabularies the intersection is the whole vocabulary and TLI is exactly standard SD,
so this is TLI with a check that the pair qualifies.
"""

from hetspec.algorithms.tli import TokenLevelIntersection


class StandardSpeculativeDecoding(TokenLevelIntersection):
    name = "sd"

    def __init__(self, maps, speculation):
        if maps is not None and not maps.same_vocabulary:
            raise ValueError("algorithm 'sd' needs a drafter with the target's vocabulary; "
                             "use 'slem', 'tli', 'slrs' or 'auto' for this pair")
        super().__init__(maps, speculation)
