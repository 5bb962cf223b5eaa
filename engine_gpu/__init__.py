"""The torch engine tier: paged KV, a token-budget scheduler, the model runner, and the core process with its async client."""
