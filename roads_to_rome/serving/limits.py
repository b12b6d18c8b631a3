"""Every limit one client's request meets (`Limits`): the server's flags and what each costs; and how the server's
scheduler admits and reads requests (`SERVER_SCHEDULING`, its default)."""

from __future__ import annotations

from dataclasses import dataclass

from roads_to_rome.core.prefix_cache import PREFIX_TOKENS
from roads_to_rome.core.scheduler import Scheduling


@dataclass
class Limits:
    """Every limit one client's request meets. The defaults follow OpenAI's API and vLLM where they have one."""

    max_batch: int = 8  # requests decoding (or having their prompt read) at once
    max_queue: int = 64  # requests waiting for a slot; beyond that: 429
    max_tokens: int = 4096  # the most new tokens one request may ask for
    context_length: int = 32768  # prompt + new tokens of one request
    max_body_bytes: int = 1 << 20  # a request body's limit (413 beyond): 8x what the longest context holds
    # OpenAI's limit. Every row decodes its tail and searches it for each stop string every step, on the engine
    # thread, and a stream holds back the longest one's length: both stay small.
    max_stop_strings: int = 4
    max_stop_chars: int = 256
    # vLLM's bad_words, each tokenized on arrival and looked up at every token of the row: as many as a long list of
    # slurs and misspellings holds, each a word or a phrase.
    max_bad_words: int = 1024
    max_bad_word_chars: int = 256
    # Token ids one list of a request may name (allowed_token_ids, stop_token_ids, logit_bias), and tools one chat
    # may offer (OpenAI's limit).
    max_token_ids: int = 16384
    max_tools: int = 128
    # A structured output is compiled off the event loop, one at a time; past this it is a 400 naming the field (a
    # 500 KiB schema takes seconds on a server's busy cores).
    max_compile_seconds: float = 10.0
    # A prompt whose log-probabilities are asked for is read whole as it is admitted, holding up the other streams
    # for as long: at most this many tokens (its logits are looked at in chunks, so memory is not what bounds it).
    max_scored_prompt_tokens: int = 8192
    # A chat template a request brings (--trust-request-chat-template) writes its chat in a process of its own,
    # within this time and this much memory beyond what the process holds (a 400 past either).
    max_template_seconds: float = 5.0
    max_template_bytes: int = 128 << 20
    # Long prompts waiting to be tokenized (or being tokenized) at once; beyond that: 429 before anything queues.
    # Short prompts have a lane of their own, so a flood of long ones cannot hold them up.
    max_tokenizing: int = 4
    max_head_seconds: float = 10.0  # a request's line and headers must arrive within this (408; connections.py)
    max_body_seconds: float = 30.0  # a body must arrive within this (408): a trickling client is cut off
    # Requests in the server at once, queued and streaming included (429 beyond); connections open at once, twice
    # this (closed as they open beyond: connections.py).
    max_connections: int = 256
    max_request_seconds: float = 600.0  # a whole (non-streamed) answer's deadline (408)
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after a shutdown signal
    # The Responses API's stored responses (their JSON), the least recently used dropped beyond it
    responses_store_bytes: int = 64 << 20


# Prompt tokens read per model between two decode steps: large enough to read a prompt near the best rate, small
# enough that running streams keep getting tokens while it is read (README, "Serving"); prompts each model keeps read
# for newcomers whose prompt begins the same way; waiting requests admitted in arrival order (--scheduling-policy
# fcfs; priority: by their `priority`, lower first).
SERVER_SCHEDULING = Scheduling(prefill_chunk=64, prefix_tokens=PREFIX_TOKENS, by_priority=False)
