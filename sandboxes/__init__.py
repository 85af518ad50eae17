"""sandboxes package."""

__all__: list[str] = []
