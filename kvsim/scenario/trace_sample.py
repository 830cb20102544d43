"""A smaller replay of a trace with prefix blocks that keeps its reuse: whole conversations
sampled from a window, each prompt scaled with its blocks.

A trace like Mooncake's (kvsim.scenario.request_trace) is too large for the emulator: an
hour of 12,031 requests whose prompts average 12,035 tokens. Sampling requests at random
would cut the chains of turns that reuse each other's blocks; these functions keep them:

- `scale_blocks`: every block of `trace_block_tokens` tokens becomes one of `block_tokens`
  tokens, and a prompt of L tokens one of ceil(L * block_tokens / trace_block_tokens): it
  has as many blocks as before, with the same ids, so the same requests share the same
  prefixes. A trace whose requests do not have ceil(L / trace_block_tokens) blocks is
  refused (its blocks would not be of that size).
- `sample_conversations`: a conversation is the requests whose first block after the
  prefix every request shares (Mooncake's conversation trace: a system prompt of one block)
  is the same; a request with no such block is a conversation of its own. The first N
  conversations, by their first request's arrival, with at least `min_turns` requests and no
  prompt longer than `max_context_tokens`, are kept, with all their requests.

Keeping the first N multi-turn conversations biases the sample towards reuse (the trace's
single-turn requests reuse only the shared prefix): it is a test of how reused blocks are
sent, not of how often a production mix reuses them (kvsim sim on the whole trace says
that).
"""

from __future__ import annotations

import numpy as np

from kvsim.scenario.request_trace import RequestTrace


def _blocks(trace: RequestTrace) -> tuple[tuple[int, ...], ...]:
    if trace.prefix_blocks is None:
        raise ValueError(f"workload trace {trace.source} has no prefix blocks (a Mooncake "
                         "JSONL trace has them: hash_ids)")
    return trace.prefix_blocks


def scale_blocks(trace: RequestTrace, trace_block_tokens: int, block_tokens: int
                 ) -> RequestTrace:
    """The trace with `trace_block_tokens`-token blocks scaled to `block_tokens` tokens:
    context_tokens -> ceil(context * block_tokens / trace_block_tokens), the same block ids.
    Arrivals and output tokens unchanged."""
    if trace_block_tokens < 1 or block_tokens < 1:
        raise ValueError(f"block sizes must be >= 1 token, got {trace_block_tokens} (the "
                         f"trace's) and {block_tokens}")
    blocks = _blocks(trace)
    context = trace.context_tokens.astype(np.int64)
    counts = np.asarray([len(b) for b in blocks], dtype=np.int64)
    wrong = np.nonzero(counts != -(-context // trace_block_tokens))[0]
    if wrong.size:
        i = int(wrong[0])
        raise ValueError(f"workload trace {trace.source}: request {i} has {int(counts[i])} "
                         f"blocks for {int(context[i])} tokens, not ceil(tokens / "
                         f"{trace_block_tokens}); is the trace's block size "
                         f"{trace_block_tokens} tokens?")
    scaled = -(-context * block_tokens // trace_block_tokens)
    return RequestTrace(trace.arrival_s, scaled, trace.output_tokens, trace.source, blocks)


def conversation_keys(trace: RequestTrace) -> list[int | None]:
    """Per request, its conversation: the first block id after the prefix that every
    request of the trace shares (None: a request with no block after it)."""
    blocks = _blocks(trace)
    shared = 0
    if blocks:
        first = blocks[0]
        shared = len(first)
        for b in blocks[1:]:
            n = min(shared, len(b))
            shared = next((j for j in range(n) if b[j] != first[j]), n)
            if shared == 0:
                break
    return [b[shared] if len(b) > shared else None for b in blocks]


def sample_conversations(trace: RequestTrace, conversations: int, min_turns: int = 2,
                         max_context_tokens: int = 0) -> RequestTrace:
    """The requests of the first `conversations` conversations (by first arrival) with at
    least `min_turns` requests and every prompt at most `max_context_tokens` tokens (0: any),
    in arrival order, arrivals from the first of them."""
    if conversations < 1 or min_turns < 1 or max_context_tokens < 0:
        raise ValueError(f"conversations and min_turns must be >= 1 and max_context_tokens "
                         f">= 0, got {conversations}, {min_turns}, {max_context_tokens}")
    members: dict[int | None | tuple[str, int], list[int]] = {}
    for i, key in enumerate(conversation_keys(trace)):
        members.setdefault(("alone", i) if key is None else key, []).append(i)
    longest = trace.context_tokens
    kept = [rows for rows in members.values()  # insertion order: by first arrival
            if len(rows) >= min_turns and
            (max_context_tokens == 0 or int(longest[rows].max()) <= max_context_tokens)]
    if len(kept) < conversations:
        raise ValueError(f"workload trace {trace.source}: {len(kept)} conversations with >= "
                         f"{min_turns} requests and prompts <= {max_context_tokens or 'any'} "
                         f"tokens, {conversations} asked; widen the window or lower the "
                         "count")
    rows = np.asarray(sorted(i for c in kept[:conversations] for i in c), dtype=np.int64)
    t = trace.arrival_s[rows]
    blocks = _blocks(trace)
    return RequestTrace(t - t[0], trace.context_tokens[rows], trace.output_tokens[rows],
                        trace.source, tuple(blocks[i] for i in rows.tolist()))
