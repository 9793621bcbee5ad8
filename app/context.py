"""What the server shares across requests, as one typed object instead of an untyped ``app.state`` bag.

``app.api.create_app`` makes it and stores it on the app once; routes and dependencies get it through
``Depends(app_context)`` (``app.deps.Context``), the reloader and the start-up code hold it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.applications import Starlette

from app.compute import ComputeSlots
from app.metrics import Metrics
from app.middleware import UploadSlots
from app.reload import Reloader
from app.settings import Settings
from app.state import EngineState
from engine.decode.pool import DecodePool


@dataclass
class AppContext:
    settings: Settings
    metrics: Metrics
    uploads: UploadSlots  # the upload slots the middleware takes and /readyz looks at
    engine: EngineState = field(default_factory=EngineState)  # replaced by the start-up load
    reloader: Reloader = field(init=False)  # every change of the served bundle (``app.reload``)
    # Made at start-up: the limiter belongs to the event loop, and the decode processes start then.
    compute: ComputeSlots = field(init=False)
    decoder: DecodePool = field(init=False)

    def __post_init__(self) -> None:
        self.reloader = Reloader(self)

    def store(self, app: Starlette) -> None:
        app.state.context = self

    @staticmethod
    def of(app: Starlette) -> AppContext:
        """The context :meth:`store` put on ``app``: the one read of ``app.state``."""
        return app.state.context
