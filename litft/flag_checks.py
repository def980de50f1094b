"""One-line checks of a flag's value, shared by every flag group (litft.config, litft.objectives.args, the data modules)."""

import math
from typing import Optional

from litft.errors import LitftError


def at_least(value: Optional[float], minimum: float, flag: str, nullable: str = "") -> None:
    """One line for a flag below its minimum (or not a finite number); ``nullable`` says what null means, where null is allowed."""
    if value is not None and not (value >= minimum and math.isfinite(value)):
        raise LitftError(f"{flag} must be at least {minimum}{f' (or null {nullable})' if nullable else ''}, got {value}")


def positive(value: Optional[float], flag: str, what: str = "", nullable: str = "") -> None:
    """One line for a flag that must be a finite number above zero; ``what`` says what it is."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        detail = f" ({what})" if what else ""
        raise LitftError(f"{flag} must be positive{detail}{f' or null {nullable}' if nullable else ''}, got {value}")


def fraction(value: float, flag: str, what: str) -> None:
    """One line for a flag that must lie in [0, 1)."""
    if not 0 <= value < 1:
        raise LitftError(f"{flag} is {what} in [0, 1), got {value}")
