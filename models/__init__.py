"""What every process shares about the served model: its facts (info), tokenizer, the built-in
models, and the memory sizes the scheduler and the runner agree on. Actors and the launcher
import this layer and protocol, never each other."""
