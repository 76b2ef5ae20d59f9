"""The HTTP server: `python -m tidejax.server --profile NAME|PATH`.

Layers, thin to thick: app.py (routes, auth, the error middleware, /health, /metrics) ->
openai_api.py / anthropic_api.py (response shapes, streaming) -> generation.py (the served
model, prompt and budget checks, one request from token events to text) -> client.py (the
EngineClient protocol: all the server sees of an engine; runtime/client.py serves it from an
engine in this process). schemas.py checks request bodies; errors.py writes every error in its
API's shape (chat templates: text/chat_template.py); text/toolcalls.py parses
reasoning and tool calls out of the text.
"""
