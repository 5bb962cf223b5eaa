"""The aiohttp application: what it holds, the OpenAI-compatible HTTP routes and their schema, the demo page, model files."""
