"""Speculative decoding counters (host): what the engine stats, the bench JSON and /metrics report."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecStats:
    k: int
    num_drafts: int = 0            # verified rows that carried at least one draft token
    num_draft_tokens: int = 0      # draft tokens verified
    num_accepted_tokens: int = 0   # draft tokens accepted (kept as output)
    accepted_per_position: list = dataclasses.field(default_factory=list)  # [k]: drafts accepted at position j

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k

    def record(self, num_draft: int, num_accepted: int):
        if not 0 <= num_accepted <= num_draft <= self.k:
            raise ValueError(f"spec stats: {num_accepted} accepted of {num_draft} drafts (k = {self.k})")
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified row with drafts: accepted drafts + the one target token
        (vLLM's "mean acceptance length"; 1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return dict(spec_num_drafts=self.num_drafts, spec_num_draft_tokens=self.num_draft_tokens,
                    spec_num_accepted_tokens=self.num_accepted_tokens, spec_acceptance_rate=self.acceptance_rate,
                    spec_mean_accepted_length=self.mean_accepted_length,
                    spec_accepted_per_position=list(self.accepted_per_position))
