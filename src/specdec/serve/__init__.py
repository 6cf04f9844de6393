"""An OpenAI-compatible HTTP server over the continuous-batching engine (``specdec serve``).

``create_app(engine, target)`` builds the FastAPI app; ``BackgroundServer(app)`` runs it on a thread.
"""

from specdec.serve.app import create_app
from specdec.serve.runner import EngineRunner
from specdec.serve.server import BackgroundServer

__all__ = ["BackgroundServer", "EngineRunner", "create_app"]
