"""Benchmark harness: methods side by side on the same prompts, with results, report and plots."""
