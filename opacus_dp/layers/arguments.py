"""Constructor argument checks shared by the DP layers (errors name the layer and argument)."""


def check_positive_int(owner: str, name: str, value, allow_zero: bool = False) -> None:
    """``value`` must be an int >= 1 (>= 0 with ``allow_zero``); bools are refused."""
    minimum = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{owner}: {name} must be {bound} int, got {value!r}")


def check_probability(owner: str, name: str, value) -> None:
    """``value`` must be a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{owner}: {name} must be a number in [0, 1], got {value!r}")
