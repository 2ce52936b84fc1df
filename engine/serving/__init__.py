"""Serving many requests on one model: KV slots kept per conversation, decode steps over every active sequence."""
