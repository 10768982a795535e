"""Drafters behind one protocol: propose(context) -> Draft, observe(result)."""
