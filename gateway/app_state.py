"""What the REST routes read, set once on ``app.state`` by ``gateway.app.create_app`` and
handed to each route as a FastAPI dependency (:data:`Served`), so that the routes live at
module level (``gateway/routes_*.py``) instead of closing over the factory's arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import unknown_model
from gateway.generation import GenerationService
from gateway.status import PlannerReader


@dataclass(frozen=True, slots=True)
class ServedState:
    service: GenerationService
    model_name: str  # what clients send as "model" and /v1/models lists
    api_key: str | None
    # Whether the loop that keeps the instance pool current still runs: without it the gateway
    # routes on reports that only age, so /health answers 503.
    discovery_alive: Callable[[], bool]
    status_page: str  # the status page's HTML, read once at start
    planner: PlannerReader | None = None  # --planner-url: the planner's decisions on the status page

    def check_model(self, model: str | None) -> None:
        """Raises APIError (404) for a model other than the served one; None: the served one."""
        if model is not None and model != self.model_name:
            raise unknown_model(model, self.model_name)

    def is_ready(self) -> bool:
        return self.discovery_alive() and self.service.pool.is_ready()


async def served_state(request: Request) -> ServedState:
    """``async``: FastAPI runs a plain ``def`` dependency on its thread pool, a thread hop for
    every request on the gateway's hottest path; this one only reads an attribute."""
    state: ServedState = request.app.state.served
    return state


Served = Annotated[ServedState, Depends(served_state)]
