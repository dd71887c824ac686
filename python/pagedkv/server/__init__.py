"""OpenAI-compatible HTTP server (`pagedkv serve`) with Prometheus metrics under vLLM's names.

Importing this package needs the server extras (fastapi, uvicorn, prometheus_client); `import pagedkv` does not.
"""

from pagedkv.server.api_server import ServerOptions, build_app, run_server, serve

__all__ = ["ServerOptions", "build_app", "run_server", "serve"]
