"""Exact-token capture for agentic GRPO, laid out like NeMo-RL."""
