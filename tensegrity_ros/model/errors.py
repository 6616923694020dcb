"""The one error type for bad structure files: it names the file, the key path and the value."""
from __future__ import annotations


class StructureError(ValueError):
    """A structure file (or dict) that cannot be simulated correctly.

    ``str(err)`` reads ``FILE: KEY.PATH = VALUE: what is wrong (how to fix)``.
    """

    def __init__(self, source: str, key: str, value, problem: str):
        self.source, self.key, self.value, self.problem = source, key, value, problem
        super().__init__(f"{source}: {key} = {value!r}: {problem}")
