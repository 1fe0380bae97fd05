"""User-facing errors: the CLI prints them as one line and exits non-zero, without a traceback."""


class SpecgraphError(Exception):
    """A mistake in what the user gave us (recipe, checkpoint, device, prompt)."""


class RecipeError(SpecgraphError):
    """The recipe is malformed or describes an impossible topology."""


class CheckpointError(SpecgraphError):
    """A checkpoint folder cannot be used (missing files, unsupported architecture, pickles)."""


class PromptError(SpecgraphError):
    """One request cannot be decoded (too long, a bad token budget); the program is fine. `field`:
    the request's setting at fault (prompt, max_new_tokens, temperature, ...), where one is (a
    server names it to its client)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RecipeWarning(UserWarning):
    """A recipe that runs but is likely not what its author meant (the CLI prints it as one line)."""
