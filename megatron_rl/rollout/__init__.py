"""The rollout side: vLLM server launcher, its worker extension, and the async client."""
