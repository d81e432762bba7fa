"""Distribution schemes behind one interface, looked up by name."""

from __future__ import annotations

from dpkfac.strategies.base import Preconditioned, Strategy
from dpkfac.strategies.d_kfac import DKFAC
from dpkfac.strategies.dp_kfac import DPKFAC
from dpkfac.strategies.spd_kfac import SPDKFAC

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DPKFAC, DKFAC, SPDKFAC)}

__all__ = ["DKFAC", "DPKFAC", "SPDKFAC", "STRATEGIES", "Preconditioned", "Strategy"]
