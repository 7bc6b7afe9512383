"""Engine settings that are read once, when the private step is built (the budget guard's ε
and δ, ...): a change made afterwards would be silently ignored, so it is refused, naming the
way to make it."""

from typing import Callable


def setting_read_once(name: str, *, in_use: Callable[[object], bool], fix: str) -> property:
    """A property stored as ``_name`` whose setter raises ``AttributeError`` (naming ``fix``)
    while ``in_use(engine)``; setting the value it already has is allowed."""

    def fset(engine, value) -> None:
        if in_use(engine) and value != getattr(engine, "_" + name, None):
            raise AttributeError(f"{name} was read when the private step was built, so a change now would be "
                                 f"ignored: {fix.format(name=name)}")
        setattr(engine, "_" + name, value)

    return property(lambda engine: getattr(engine, "_" + name), fset)
