"""The CPU demo: a synthetic multiple-choice task, a locally trained tokenizer, a tiny model."""
