"""Acceptance statistics: a histogram of accepted drafts per request-step.

AL (acceptance length) = 1 + sum_i i * hist[i] / sum_i hist[i]; the denominator counts
request-steps (one per request per verify), not executor iterations.
"""
from __future__ import annotations

import json
from pathlib import Path


class AcceptStats:
    def __init__(self, max_draft_len: int):
        self.hist = [0] * (max_draft_len + 1)
        self.draft_tokens = 0
        self.skipped_writes = 0        # draft writes clamped off by the page bound

    def record(self, num_accepted: int, num_drafted: int) -> None:
        if not 0 <= num_accepted <= num_drafted < len(self.hist):
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafts (max {len(self.hist) - 1})")
        self.hist[num_accepted] += 1
        self.draft_tokens += num_drafted

    @staticmethod
    def acceptance_length(hist: list[int]) -> float:
        steps = sum(hist)
        return 1.0 + sum(i * h for i, h in enumerate(hist)) / steps if steps else 0.0

    def as_dict(self) -> dict:
        steps = sum(self.hist)
        accepted = sum(i * h for i, h in enumerate(self.hist))
        return {"accept_histogram": list(self.hist), "request_steps": steps,
                "acceptance_length": self.acceptance_length(self.hist),
                "draft_tokens": self.draft_tokens, "accepted_tokens": accepted,
                "acceptance_rate": accepted / self.draft_tokens if self.draft_tokens else 0.0,
                "page_bound_skipped_writes": self.skipped_writes}

    def write(self, folder: Path, rank: int = 0) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        f = folder / f"dspark_accept_stats_rank{rank}.json"
        f.write_text(json.dumps(self.as_dict(), indent=2))
        return f
