"""What a bench run sends: synthetic prompts from a small built-in corpus, or prompts from a dataset file."""
