"""Synthetic workloads whose prompts share prefixes, for prefix caching.

  * `shared_prefix_workload`: every prompt is one of a few system prompts
    (popular ones chosen more often, Zipf) followed by a private suffix.
  * `conversation_workload`: multi-turn chats; each turn's prompt is the whole
    conversation so far (every earlier message and answer) and a new message.

Both always give token ids (sharing is a matter of ids) and draw every part from
its own stream spawned from the seed, as `synthetic.synthetic_workload` does, so
changing one knob leaves the other parts as they were.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Optional, Union

import numpy as np

from orca_jax.core.requests.request import Request
from orca_jax.workloads.synthetic import (
    LengthDistribution,
    arrival_times,
    as_distribution,
    check_seed,
    check_vocab_size,
    placeholder_tokens,
    random_tokens,
)

Length = Union[LengthDistribution, str]


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _fits(num_tokens: int, context: Optional[int]) -> bool:
    """Whether a request of `num_tokens` (prompt and output) can run: within the context."""
    return context is None or num_tokens <= context


def _check_rate(rate: float, what: str) -> None:
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 ({what} per second), got {rate!r}")


def shared_prefix_workload(*, num_requests: int, rate: float, num_prefixes: int,
                           prefix_len: Length, prefix_zipf: float, suffix_len: Length,
                           output_len: Length, seed: int, vocab_size: int,
                           context: Optional[int] = None) -> list[Request]:
    """Requests whose prompts are a shared system prompt and a private suffix.

    `num_prefixes` system prompts are drawn once (each its own length from
    `prefix_len`, its own random ids). Each request picks system prompt k
    (0-based) with probability proportional to (k + 1)**-prefix_zipf, so prompt
    0 is the most popular, and appends a private suffix of random ids. Arrivals
    are Poisson at `rate`.

    Args:
      num_requests: number of requests (>= 1).
      rate: requests per second (> 0).
      num_prefixes: number of system prompts (>= 1).
      prefix_len: the system prompts' length distribution (or spec string).
      prefix_zipf: the popularity exponent (>= 0; 0 picks uniformly).
      suffix_len: the private suffixes' length distribution.
      output_len: the outputs' length distribution.
      seed: non-negative integer; the same seed gives the same workload bit for bit.
      vocab_size: ids are drawn from [1, vocab_size).
      context: the run's context limit, if known: a system prompt longer than it, or
        a request whose prompt and output exceed it, gets `placeholder_tokens` (it is
        rejected before any step reads them) instead of drawn ids.

    Returns:
      The requests in arrival order, with ids 0..N-1.
    """
    check_seed(seed)
    check_vocab_size(vocab_size)
    _check_count("num_requests", num_requests)
    _check_count("num_prefixes", num_prefixes)
    _check_rate(rate, "requests")
    if not (isinstance(prefix_zipf, (int, float)) and math.isfinite(prefix_zipf)
            and prefix_zipf >= 0):
        raise ValueError(f"prefix_zipf must be a finite number >= 0, got {prefix_zipf!r}")
    prefix_dist = as_distribution(prefix_len, "prompt_len", "prefix_len")
    suffix_dist = as_distribution(suffix_len, "prompt_len", "suffix_len")
    output_dist = as_distribution(output_len, "output_len", "output_len")
    (arrival_seq, prefix_seq, choice_seq, suffix_seq, output_seq,
     suffix_token_seq) = np.random.SeedSequence(int(seed)).spawn(6)
    arrivals = arrival_times("poisson", num_requests, np.random.default_rng(arrival_seq),
                             rate=rate)  # [N]
    prefix_rng = np.random.default_rng(prefix_seq)
    prefixes = [random_tokens(prefix_rng, int(n), vocab_size) if _fits(int(n), context)
                else placeholder_tokens(int(n))
                for n in prefix_dist.sample(prefix_rng, num_prefixes)]
    weights = np.arange(1, num_prefixes + 1, dtype=np.float64) ** -float(prefix_zipf)  # [P]
    choices = np.random.default_rng(choice_seq).choice(
        num_prefixes, size=num_requests, p=weights / weights.sum())  # [N]
    suffix_lens = suffix_dist.sample(np.random.default_rng(suffix_seq), num_requests)  # [N]
    output_lens = output_dist.sample(np.random.default_rng(output_seq), num_requests)  # [N]
    token_rng = np.random.default_rng(suffix_token_seq)
    requests = []
    for i in range(num_requests):
        prefix = prefixes[choices[i]]
        total = len(prefix) + int(suffix_lens[i])
        if _fits(total + int(output_lens[i]), context):
            prompt = np.concatenate([prefix, random_tokens(token_rng, int(suffix_lens[i]),
                                                           vocab_size)])
        else:
            prompt = placeholder_tokens(total)
        requests.append(Request(id=i, arrival_s=float(arrivals[i]), prompt_len=len(prompt),
                                output_len=int(output_lens[i]), prompt_tokens=prompt))
    return requests


def _conversation(index: int, start_s: float, seed: int, num_turns: LengthDistribution,
                  think_time_ms: LengthDistribution, message_len: LengthDistribution,
                  output_len: LengthDistribution, vocab_size: int,
                  context: Optional[int] = None) -> list[Request]:
    """Conversation `index`'s turns (ids still to be given), from its own streams.

    Its streams depend on (seed, index) alone, so a conversation is the same
    whichever others are drawn beside it. From the first turn that exceeds
    `context` on, every turn does (the history only grows): those get
    `placeholder_tokens`, prompt and answer.
    """
    # spawn_key (1, index): the children of the seed's second stream (the first is arrivals).
    length_seq, think_seq, token_seq = np.random.SeedSequence(
        int(seed), spawn_key=(1, index)).spawn(3)
    length_rng = np.random.default_rng(length_seq)
    count = int(num_turns.sample(length_rng, 1)[0])
    message_lens = message_len.sample(length_rng, count)  # [T]
    output_lens = output_len.sample(length_rng, count)  # [T]
    thinks_s = think_time_ms.sample(np.random.default_rng(think_seq), count) / 1000  # [T]
    token_rng = np.random.default_rng(token_seq)
    history = np.zeros(0, dtype=np.int32)  # every earlier message and answer
    arrival_s = start_s
    turns = []
    for k in range(count):
        prompt_len = len(history) + int(message_lens[k])
        if _fits(prompt_len + int(output_lens[k]), context):
            prompt = np.concatenate([history, random_tokens(token_rng, int(message_lens[k]),
                                                            vocab_size)])
            answer = random_tokens(token_rng, int(output_lens[k]), vocab_size)
            history = np.concatenate([prompt, answer])
        else:  # too long for the context: this turn and every later one
            prompt = placeholder_tokens(prompt_len)
            answer = placeholder_tokens(int(output_lens[k]))
            history = placeholder_tokens(prompt_len + len(answer))
        turns.append(Request(id=0, arrival_s=arrival_s, prompt_len=len(prompt),
                             output_len=len(answer), prompt_tokens=prompt,
                             planned_output_tokens=answer, conversation_id=index, turn=k))
        arrival_s += float(thinks_s[k])
    return turns


def conversation_workload(*, num_requests: int, rate: float, num_turns: Length,
                          think_time_ms: Length, message_len: Length, output_len: Length,
                          seed: int, vocab_size: int,
                          context: Optional[int] = None) -> list[Request]:
    """Multi-turn conversations: each turn a request whose prompt holds the conversation so far.

    Conversations start as a Poisson process at `rate`. Conversation c has a
    number of turns (`num_turns`); turn 0 arrives at its start and turn k + 1
    a think time (`think_time_ms`) after turn k. Turn k's prompt is exactly
    turn 0's message and answer, ..., turn k - 1's message and answer, then
    a new message of `message_len` random ids; its answer is planned up front
    (`Request.planned_output_tokens`, `output_len` random ids), since the
    workload is fixed before any engine runs. Turns arrive open loop: a turn
    may arrive before the previous turn's answer is done; a real engine's
    sampled answer differs from the planned one, and the next prompt holds
    the planned one.

    The workload is the first `num_requests` turns in arrival order (ties:
    conversation, then turn order), so a larger `num_requests` extends it; a
    conversation cut off keeps its earlier turns.

    Args:
      num_requests: number of requests, i.e. turns (>= 1).
      rate: conversations per second (> 0).
      num_turns: the turns per conversation's distribution (or spec string).
      think_time_ms: the gaps between a conversation's turns, in milliseconds.
      message_len: each turn's new message's length distribution.
      output_len: each turn's answer's length distribution.
      seed: non-negative integer; the same seed gives the same workload bit for bit.
      vocab_size: ids are drawn from [1, vocab_size).
      context: the run's context limit, if known: turns that exceed it get
        `placeholder_tokens` (they are rejected before any step reads them).

    Returns:
      The turns in arrival order, with ids 0..N-1; each carries its
      `conversation_id` (conversations numbered by start) and `turn`.
    """
    check_seed(seed)
    check_vocab_size(vocab_size)
    _check_count("num_requests", num_requests)
    _check_rate(rate, "conversations")
    dists = (as_distribution(num_turns, "num_turns", "num_turns"),
             as_distribution(think_time_ms, "think_time_ms", "think_time_ms"),
             as_distribution(message_len, "prompt_len", "message_len"),
             as_distribution(output_len, "output_len", "output_len"))
    arrival_rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(0,)))
    turns: list[Request] = []
    pending: list[float] = []  # min-heap of the arrivals not yet known to be in the first N
    num_settled = 0  # turns that arrive no later than the next conversation's start
    index, start_s = 0, 0.0
    # A later conversation's turns all arrive at or after its start, and sort after the
    # turns drawn so far on ties: once N turns arrive by the next start, the first N are known.
    while num_settled < num_requests:
        for turn in _conversation(index, start_s, seed, *dists, vocab_size, context):
            turns.append(turn)
            heapq.heappush(pending, turn.arrival_s)
        index += 1
        start_s += float(arrival_rng.standard_exponential()) / rate
        while pending and pending[0] <= start_s:
            heapq.heappop(pending)
            num_settled += 1
    turns.sort(key=lambda r: (r.arrival_s, r.conversation_id, r.turn))
    return [dataclasses.replace(r, id=i) for i, r in enumerate(turns[:num_requests])]
