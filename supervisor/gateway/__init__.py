"""The OpenAI-compatible gateway: routes (app), request shapes (openai), replica choice (router),
and requests that survive an engine's death (relay)."""
