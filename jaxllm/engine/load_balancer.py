"""Which data-parallel replica (engine-core process) a front end sends a request to.

Plain Python, no JAX: the front end decides on its event loop, per request, in microseconds.

The rule, stated once:

    load(i)  = in_flight(i)                      requests this front end sent to i, not finished
             + waiting(i)                        i's waiting + swapped queue, as i last reported
             + kv_usage(i) * max_num_seqs        a full KV cache weighs as a full batch queued
    choose   the replica with the lowest load (ties: the next one in turn, so that front ends
             and idle replicas do not all pile onto replica 0);
    affinity a prompt whose first full KV blocks (up to AFFINITY_BLOCKS, the longest match
             wins) were last sent to replica r goes to r again, unless
             load(r) > lowest load + affinity_slack; there its prefix is likely cached.

Requests this front end queued count in both ``in_flight`` and ``waiting`` (once reported):
queued work weighs more than running work, as vLLM's ``4 * waiting + running`` does. Prompts
shorter than one block have no prefix key (prefix caching reuses full blocks only). Other
front ends' requests reach the score through the replicas' reports only.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

AFFINITY_BLOCKS = 4  # prefix keys per prompt: its first 1 .. 4 full blocks
AFFINITY_ENTRIES = 8192  # prefix keys remembered (least recently used dropped first)


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """What a replica last reported of itself (core_process's "load" message)."""

    waiting: int = 0  # waiting + swapped requests, every front end's
    running: int = 0
    kv_usage: float = 0.0  # fraction of its usable KV blocks in use


class LoadBalancer:
    def __init__(self, num_replicas: int, block_size: int, max_num_seqs: int,
                 affinity_slack: float | None = None):
        """``affinity_slack``: how much more loaded (in requests) the replica holding a prompt's
        prefix may be than the least loaded one and still get it; default max(2, a
        replica's max_num_seqs / 8), about what a prefix hit saves against a wait."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.affinity_slack = (max(2.0, max_num_seqs / 8) if affinity_slack is None
                               else affinity_slack)
        self.in_flight = [0] * num_replicas
        self.reported = [ReplicaLoad()] * num_replicas
        self._prefixes: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._turn = 0

    def load(self, replica: int) -> float:
        r = self.reported[replica]
        return self.in_flight[replica] + r.waiting + r.kv_usage * self.max_num_seqs

    def choose(self, prompt_token_ids: Sequence[int] | None) -> int:
        """The replica for a new request (then call :meth:`added`)."""
        n = self.num_replicas
        if n == 1:
            return 0
        loads = [self.load(i) for i in range(n)]
        turn = self._turn
        best = min(range(n), key=lambda i: (loads[i], (i - turn) % n))
        self._turn = (turn + 1) % n
        keys = self.prefix_keys(prompt_token_ids)
        for key in reversed(keys):  # the longest shared prefix first
            owner = self._prefixes.get(key)
            if owner is not None:
                if loads[owner] <= loads[best] + self.affinity_slack:
                    best = owner
                break
        for key in keys:
            self._prefixes[key] = best
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > AFFINITY_ENTRIES:
            self._prefixes.popitem(last=False)
        return best

    def prefix_keys(self, prompt_token_ids: Sequence[int] | None) -> list[int]:
        """Chained hashes of the prompt's first full blocks: key k covers blocks 0 .. k."""
        if not prompt_token_ids:
            return []
        size = self.block_size
        blocks = min(AFFINITY_BLOCKS, len(prompt_token_ids) // size)
        keys, key = [], 0
        for b in range(blocks):
            key = hash((key, tuple(prompt_token_ids[b * size:(b + 1) * size])))
            keys.append(key)
        return keys

    def added(self, replica: int) -> None:
        self.in_flight[replica] += 1

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def report(self, replica: int, load: ReplicaLoad) -> None:
        self.reported[replica] = load
