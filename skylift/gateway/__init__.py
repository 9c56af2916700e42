"""An OpenAI-compatible gateway that records the exact tokens an agent program samples, so an
existing agent (an ``openai``-client loop, mini-SWE-agent, ...) trains unmodified inside
``skylift train`` (``environment.harness``; docs/agentic.md, "Training an existing agent").

- `skylift.gateway.server`: `Gateway`, the per-run server and one call's sampling and record;
- `skylift.gateway.app`: its routes; `skylift.gateway.openai_format`: the chat-completions wire
  format; `skylift.gateway.responses_format`: the Responses API's, over the same calls;
- `skylift.gateway.session`: a rollout's session, its budget and its calls;
- `skylift.gateway.trajectories`: calls -> step-wise trajectories, merged where they extend;
- `skylift.gateway.harness`: running an agent (entry point or command) and its verifier;
- `skylift.gateway.rollouts`: `HarnessRollouts`, the run's generator (a rollout plugin).
"""

from __future__ import annotations

from skylift.gateway.server import Gateway, GatewayLimits
from skylift.gateway.session import Budget, BudgetExceeded, CallRecord, Session

__all__ = ["Budget", "BudgetExceeded", "CallRecord", "Gateway", "GatewayLimits", "Session"]
