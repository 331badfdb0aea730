"""The KV-aware router: prefix index (Redis), pure routing policy, OpenAI-compatible proxy."""
