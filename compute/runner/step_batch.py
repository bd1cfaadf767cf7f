"""The flat batch of one step, as the model runner builds it and the CUDA graphs replay it.

Its own module so that both can use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compute.core.sequence import Sequence
from kernels.metadata import AttentionMetadata


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]: flat index of each sampling sequence's last token
    sampling_seqs: list[Sequence]
    # Per sampling sequence, its draft (speculative decoding): its rows in sample_rows are
    # then 1 + len(draft), the last token's and each draft token's. All empty: no drafts.
    drafts: list[tuple[int, ...]] | None = None
