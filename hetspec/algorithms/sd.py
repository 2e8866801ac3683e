"""SD: standard speculative decoding (Leviathan et al. 2023), for a drafter with the target's vocabulary.

With identical vocabularies TLI is exactly standard SD, except for the map: ids map to themselves. (The
byte-level intersection would send a token to the lowest id with the same bytes, and vocabularies such
as Gemma's hold duplicates, e.g. "\\n" and its byte-fallback twin <0x0A>, which the target would reject.)
"""

import torch

from hetspec.algorithms.base import DrafterSide
from hetspec.algorithms.tli import TokenLevelIntersection


class StandardSpeculativeDecoding(TokenLevelIntersection):
    name = "sd"

    def __init__(self, maps, speculation):
        if maps is not None and not maps.same_vocabulary:
            raise ValueError("algorithm 'sd' needs a drafter with the target's vocabulary; "
                             "use 'slem', 'tli', 'slrs' or 'auto' for this pair")
        super().__init__(maps, speculation)

    def drafter_to_target(self) -> torch.Tensor:  # [drafter_vocab] the same id, -1 past the target's logits
        identity = torch.arange(self.maps.drafter.vocab_size)
        return identity.masked_fill(identity >= self.maps.target.vocab_size, -1)

    def feed(self, drafter: DrafterSide, committed: bytes, target_id: int) -> bool:
        drafter.context.push(target_id)
        return True
