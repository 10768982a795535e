"""OpenAI-compatible HTTP server: one engine worker behind a bounded queue."""
