"""Entry points for users: the offline `LLM` facade."""
