"""Generation: the built-in inference engine (``engine/``) that turns prompts into completions."""
