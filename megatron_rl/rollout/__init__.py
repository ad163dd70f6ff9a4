"""The rollout side: vLLM server launcher, its worker extension and weight-transfer engines (`engines/`),
and the async client."""
