"""Per-request logit edits that run before penalties and the sampling filters.

The sampler (compute/sampling/sampler.py) calls ``process_logits`` once per step, first of all:

- ``logit_bias`` (OpenAI semantics): a request's bias for a token id is added to that
  token's logit in the request's row, so -100 all but bans a token and +100 all but
  forces it.
- ``min_tokens``: until a request has that many output tokens, its EOS tokens and its
  ``stop_token_ids`` get -inf, so it cannot end by a token (the scheduler does not stop
  it on one either, and stage 3 does not match stop strings before then).

Both touch only the rows that ask, and a step with no such row returns ``logits``
itself: no copy, no kernel, so the other rows are token-identical to a run without
them. Logprobs stay the model's raw ones (taken from the logits before this stage).
A request's count of output tokens at sampling time is the index of the token being
sampled: with asynchronous output the previous step's token is already a placeholder.
"""

from __future__ import annotations

import torch

from compute.core.sequence import Sequence
from kernels.transfer import device_tensor


def process_logits(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]
) -> torch.Tensor:
    """``logits`` with every row's bias added and its banned stop tokens at -inf; the same
    tensor (not a copy) when no row asks for either."""
    rows, cols, values = [], [], []
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        for token_id, bias in params.logit_bias:
            rows.append(row)
            cols.append(token_id)
            values.append(bias)
        if seq.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(eos_token_ids)
            for token_id in sorted(banned):
                rows.append(row)
                cols.append(token_id)
                values.append(float("-inf"))
    if not rows:
        return logits
    index = (
        device_tensor(rows, torch.long, logits.device),
        device_tensor(cols, torch.long, logits.device),
    )
    # accumulate: a -inf ban stays -inf whatever bias the same token also has.
    return logits.index_put(index, device_tensor(values, logits.dtype, logits.device), True)
