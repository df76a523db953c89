"""The Quart-Trio app: one blueprint per API family, SSE helpers, and the error mapping."""
