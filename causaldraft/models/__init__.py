"""Model loading and backends."""
