"""`specrt serve`: an OpenAI-compatible HTTP server over the runtime's `Service` (the `serve`
extra: Starlette, uvicorn, prometheus-client). `specrt.runtime` never imports it."""
