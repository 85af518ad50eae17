"""environments package."""

__all__: list[str] = []
