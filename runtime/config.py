"""The Engine's options, typed, in one definition: the training recipe, the guards, dynamic balancing
and leaving.

``runtime.Engine(model, plan, ..., config=EngineConfig(...))`` takes them as one value; the same
options as keywords (``Engine(..., clip_grad_norm=1.0, balance="off")``) are read through
:meth:`EngineConfig.of`, which maps each keyword to the field of the same name in its section, so
no option is defined twice. A launcher's configuration file reads the same records
(:class:`whalelike.spec.Reader` follows the fields' rules).

=================  ==========================================================================
section            fields
=================  ==========================================================================
``recipe``         ``precision`` (None: the plan's), ``grad_reduce_dtype``, ``clip_grad_norm``,
                   ``measure_memory`` (:mod:`runtime.training`)
``guards``         ``timeout_s``, ``on_nonfinite``, ``batch_check_every`` (:mod:`runtime.guards`),
                   ``memory_check`` (:mod:`runtime.balance.memory_check`)
``balance``        :class:`runtime.balance.rebalance.BalanceConfig` (keyword ``balance``: a policy
                   name or the record)
``leave``          :class:`runtime.elastic.departure.LeaveConfig`, or None: off (keyword
                   ``departures``: True, False, None or the record)
=================  ==========================================================================

Invariant: every record checks its values when built, with the error the option has always had
(the thing, the bad value, the fix), so a bad option fails on every rank before the rendezvous.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from runtime import guards
from runtime.balance.rebalance import BalanceConfig
from runtime.elastic.departure import LeaveConfig
from runtime.training.clipping import check_max_norm
from runtime.training.precision import GRAD_REDUCE, PRECISIONS, Precision
from whalelike.errors import WhaleError
from whalelike.spec import rule


@dataclass(frozen=True)
class RecipeConfig:
    """The training recipe around a step (:mod:`runtime.training`): ``precision`` fp32, bf16 or fp16
    (None: the plan's), ``grad_reduce_dtype`` fp32 (exact) or bf16, ``clip_grad_norm`` (the largest
    global gradient norm, None: no clipping), ``measure_memory`` (record each step's peak; None: on
    GPUs, and wherever an emulated device enforces its memory)."""

    precision: Optional[str] = rule(str, choices=PRECISIONS, default=None)
    grad_reduce_dtype: str = rule(str, choices=GRAD_REDUCE, default="fp32")
    clip_grad_norm: Optional[float] = rule(float, gt=0, default=None)
    measure_memory: Optional[bool] = rule(bool, default=None)

    def __post_init__(self):
        Precision(self.precision or "fp32", self.grad_reduce_dtype)     # its own errors name the value
        check_max_norm(self.clip_grad_norm)
        if self.measure_memory is not None and not isinstance(self.measure_memory, bool):
            raise WhaleError(f"runtime.Engine: measure_memory must be True, False or None (on GPUs), got "
                             f"{self.measure_memory!r}")


@dataclass(frozen=True)
class GuardConfig:
    """The step's guards (:mod:`runtime.guards`): ``timeout_s`` bounds every collective,
    ``on_nonfinite`` ``"raise"`` or ``"skip"`` a NaN or inf loss, ``batch_check_every`` compares
    the ranks' global batches every that many steps (0: never), ``memory_check`` compares each
    rank's measured peak with the plan's prediction a few steps into every plan and re-prices the
    plan where a rank runs above it (:mod:`runtime.balance.memory_check`; False: the plan's
    prediction is left as it is, for a benchmark of the prediction itself)."""

    timeout_s: float = rule(float, gt=0, default=300.0)
    on_nonfinite: str = rule(str, choices=guards.ON_NONFINITE, default="raise")
    batch_check_every: int = rule(int, ge=0, default=guards.DEFAULT_BATCH_CHECK_EVERY)
    memory_check: bool = rule(bool, default=True)

    def __post_init__(self):
        object.__setattr__(self, "timeout_s", guards.check_timeout(self.timeout_s))
        guards.check_options(self.on_nonfinite, self.batch_check_every)
        if not isinstance(self.memory_check, bool):
            raise WhaleError(f"runtime.Engine: memory_check must be True or False, got {self.memory_check!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Every option of :class:`runtime.engine.Engine` (see the module docstring)."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    guards: GuardConfig = field(default_factory=GuardConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    leave: Optional[LeaveConfig] = None

    @classmethod
    def of(cls, config: Optional["EngineConfig"] = None, **options: Any) -> "EngineConfig":
        """``config`` (default: the defaults) with ``options`` given as the Engine's keywords: a
        field name of ``recipe`` or ``guards``, ``balance`` (a policy name or a BalanceConfig) or
        ``departures`` (True, False, None or a LeaveConfig). An unknown keyword is an error naming
        the options."""
        config = config if config is not None else cls()
        sections: dict[str, dict[str, Any]] = {"recipe": {}, "guards": {}}
        for name, value in options.items():
            if name == "balance":
                config = dataclasses.replace(config, balance=BalanceConfig.of(value))
            elif name == "departures":
                config = dataclasses.replace(config, leave=LeaveConfig.of(value))
            elif name in _FIELDS["recipe"]:
                sections["recipe"][name] = value
            elif name in _FIELDS["guards"]:
                sections["guards"][name] = value
            else:
                known = sorted({*_FIELDS["recipe"], *_FIELDS["guards"], "balance", "departures"})
                raise WhaleError(f"runtime.Engine got an unknown option {name!r}; the options are {', '.join(known)} "
                                 "(runtime.config.EngineConfig)")
        if sections["recipe"]:
            config = dataclasses.replace(config, recipe=dataclasses.replace(config.recipe, **sections["recipe"]))
        if sections["guards"]:
            config = dataclasses.replace(config, guards=dataclasses.replace(config.guards, **sections["guards"]))
        return config


_FIELDS = {"recipe": {f.name for f in dataclasses.fields(RecipeConfig)},
           "guards": {f.name for f in dataclasses.fields(GuardConfig)}}
