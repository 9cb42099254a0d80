"""The runner's one error of its own."""


class StepError(RuntimeError):
    """The batch contradicts the runner's state: a scheduler bug, reported, never hidden."""
