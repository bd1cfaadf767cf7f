"""The one attention-metadata record a model step carries.

A step is a flat, unpadded batch of tokens from many sequences: some prefill a
chunk, some decode one token. Sequence i owns queries
``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch; after this step
its KV cache holds ``context_lens[i]`` tokens (cached prefix + this step's
tokens), so its j-th query sits at absolute position
``context_lens[i] - query_len_i + j`` and sees keys at positions <= that one
(bottom-right-aligned causal mask).

KV cache layout (per layer, key and value alike):
``[num_blocks, block_size, num_kv_heads, head_dim]``. The slot of the token at
position p of a sequence is ``block_table[p // B] * B + p % B``; slot -1 marks
padding and is skipped by the cache write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.transfer import device_tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot of each new token, -1 = skip
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    context_lens: torch.Tensor  # int32 [num_seqs]: tokens in cache after this step's write
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query offsets
    # Host-side copies, so CPU code never syncs on a device tensor:
    query_lens: list[int]  # tokens of each sequence in this step
    context_lens_host: list[int]  # same values as context_lens
    max_query_len: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the record from host lists (one entry per sequence)."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have equal length")
        slots: list[int] = []
        for qlen, clen, table in zip(query_lens, context_lens, block_tables, strict=True):
            for pos in range(clen - qlen, clen):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for qlen in query_lens:
            starts.append(starts[-1] + qlen)
        return cls(
            slot_mapping=device_tensor(slots, torch.int64, device),
            block_tables=device_tensor(padded, torch.int32, device),
            context_lens=device_tensor(context_lens, torch.int32, device),
            query_start_loc=device_tensor(starts, torch.int32, device),
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
        )
