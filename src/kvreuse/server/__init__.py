"""The OpenAI-compatible HTTP server. Entry point: :func:`kvreuse.server.api_server.build_app`."""
