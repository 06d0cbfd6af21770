"""The OpenAI-compatible routes: bodies, schemas, prompts, choices, jobs in the executor, logprobs, rendering."""
