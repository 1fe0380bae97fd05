"""Serving many requests at once: requests, a paged KV pool, a scheduler with a verification
budget, and an engine whose every step drafts and verifies all running requests together."""
