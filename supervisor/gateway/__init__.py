"""The OpenAI-compatible gateway: its routes (app), every request's admission and counts
(admission, stats), request shapes (openai), requests that survive an engine's death (relay for
engined's own engines, proxy for servers'). Which server serves a request is the router's, seen
only through its Routes (supervisor.routing.routes)."""
