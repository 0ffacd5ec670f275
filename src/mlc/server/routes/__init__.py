"""The HTTP routes, one router per API: OpenAI-compatible, the tutorial's native API, tokenize, health, and the web
UI's pages and dashboard JSON."""
