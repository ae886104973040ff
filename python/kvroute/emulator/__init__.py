"""``kvroute engine``: an OpenAI-compatible stand-in for one vLLM engine, driven in real time
by an engine model: the simulator's ``kvroute.EngineModel`` (:class:`SimEngine`, the
default) or :class:`SimpleEngine` (see ``docs/proxy.md``, "The emulator").

>>> from kvroute.emulator import EmulatorConfig, emulator_app
>>> app = emulator_app(EmulatorConfig(speedup=10))     # an aiohttp Application
"""

from __future__ import annotations

from kvroute.emulator.engine import PRESETS, Engine, EngineEvent, SimpleEngine, TimingParams
from kvroute.emulator.faults import FaultConfig
from kvroute.emulator.server import EMULATOR, Emulator, EmulatorConfig, emulator_app
from kvroute.emulator.sim_engine import SimEngine

__all__ = [
    "EMULATOR",
    "PRESETS",
    "Emulator",
    "EmulatorConfig",
    "Engine",
    "EngineEvent",
    "FaultConfig",
    "SimEngine",
    "SimpleEngine",
    "TimingParams",
    "emulator_app",
]
