"""What the proxy tells routers and data-parallel servers about a call's session, so that every
call of one agent session lands where its previous calls did (the replica's request trees and
vLLM's prefix cache hold that session's history).

* Routers in front of several servers hash a header: vllm-router's `consistent_hash` policy reads
  `X-Session-ID` first; vLLM production-stack's `--routing-logic session` reads the header named
  by its `--session-key`; others take a configurable header too. The proxy sends the session id in
  `SESSION_HEADER` (`serve --session-header` names another, or none).
* vLLM's own data parallelism (`--data-parallel-size N`) honours `X-data-parallel-rank`: the
  managed backend pins a session to rank hash(session) mod N.
* An agentaccel server upstream (a proxy in front of a router in front of agentaccel servers)
  gets the stage and session this proxy resolved (`X-Agentaccel-Stage`, `X-Agentaccel-Session`):
  every server of the fleet files the call under the same stage.
"""

from __future__ import annotations

import hashlib

from agentaccel.text.headers import header_value

SESSION_HEADER = "x-session-id"
DP_RANK_HEADER = "x-data-parallel-rank"
STAGE_HEADER = "x-agentaccel-stage"  # (proxy/tagging.py reads the same names)
AGENTACCEL_SESSION_HEADER = "x-agentaccel-session"


def session_rank(session_id: str, ranks: int) -> int:
    """The data-parallel rank of a session: stable across processes and restarts."""
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % ranks


def data_parallel_size(vllm_args: list[str]) -> int:
    """`--data-parallel-size N` / `-dp N` / `--data-parallel-size=N` in `vllm serve` arguments (1 if none)."""
    for i, arg in enumerate(vllm_args):
        if arg in ("--data-parallel-size", "-dp") and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif arg.startswith("--data-parallel-size="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"--data-parallel-size {value!r} is not a number") from None
    return 1


def upstream_headers(headers: dict[str, str], stage: str, session_id: str | None, session_header: str | None,
                     ranks: int = 1) -> dict[str, str]:
    """`headers` plus the call's stage and its session's routing headers (a client's own routing
    values are kept), each in a form a header can carry (text/headers.py)."""
    out = {**headers, STAGE_HEADER: header_value(stage)}
    if not session_id:
        return out
    session = header_value(session_id)  # a client's session id may hold anything a JSON string can
    out[AGENTACCEL_SESSION_HEADER] = session
    if session_header and session_header not in out:
        out[session_header] = session
    if ranks > 1 and DP_RANK_HEADER not in out:
        out[DP_RANK_HEADER] = str(session_rank(session_id, ranks))
    return out
