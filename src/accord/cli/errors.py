"""How the command says a user mistake: one line on stderr, from the rank that speaks for the run."""

from __future__ import annotations

import sys


def fail(message: str, code: int = 2) -> int:
    from accord.distributed import rank_env
    from accord.launch import refusal_relay as refusals

    # A process that never imported accord.distributed.group never joined a group: its rank is the
    # launcher's, and the line is printed without importing torch (a second sooner).
    dist = sys.modules.get("accord.distributed.group")
    rank0 = dist.is_main() if dist is not None else rank_env.leads()
    grouped = dist is not None and (dist.left_a_group() or dist.in_group())
    # Global rank 0, and under a multi-node outer launcher each node's local rank 0: every
    # node's log says why it stopped, not only the launcher's ChildFailedError.
    if (rank0 or rank_env.env_info().leads_node) and refusals.claim():
        for line in message.splitlines():
            print(f"accord: error: {line}", file=sys.stderr, flush=True)
    if not grouped:
        refusals.publish(message)  # refused before the nodes met: tell the other nodes
    return code
