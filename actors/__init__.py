"""The four actors: tokenizer, scheduler, model runner, detokenizer."""
