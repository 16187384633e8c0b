"""``spdkfac train --optimizer``: one row per value, in one table.

A row says which base optimizer applies the update, whether K-FAC preconditions it (and
on which layers), the defaults the optimizer runs with where neither a flag nor a config
file gives an option, and the options it fixes: an option a row fixes does not apply to
that optimizer (``unused``: left out of the run's ``config.toml``) or only one value of it
does (``fixed``), so a value other than the row's is refused with one line saying why, and
the run's ``config.toml`` records what ran. Adding an optimizer is adding a row (and its
builder, :data:`spdkfac.training.optimizers.BASE_OPTIMIZERS`, if its base is new);
docs/cli.md, "Optimizers and their defaults", tables them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from spdkfac.training.kfac_options import KFAC_FLAGS, KFACSchedules

__all__ = [
    "KFAC_ONLY",
    "OPTIMIZER_TABLE",
    "OptimizerRow",
    "check_optimizer_options",
    "optimizer_defaults",
]

#: The flat options only K-FAC reads (accumulation applies to every optimizer).
KFAC_ONLY: tuple[str, ...] = (
    *(name for name in KFAC_FLAGS if name != "accumulation_steps"),
    *(spec.name for spec in fields(KFACSchedules)),
)

_NO_KFAC = "it has no K-FAC (K-FAC options need an optimizer named kfac or kfac-*)"
_BETA1 = "its first-moment decay (beta1) is fixed at 0.9; --momentum is SGD's and Muon's"
_NO_NESTEROV = "Nesterov momentum is SGD's and Muon's"
_MUON_SCALE = (
    "Muon's orthogonalization sets the size of each step, so a rescaling before it "
    "(the KL clip, grafting) would only reweight its momentum"
)
_EIGEN_ADAM_SCALE = "the eigen-adam form's direction carries Adam's own scale (no KL clip)"
_NO_ADAMW = (
    "it has no AdamW part (beta2 is AdamW's: adamw, kfac-adamw, and the AdamW part of "
    "muon and the kfac-muon, kfac-eigen-adam and kfac-eigen-adam-muon rows)"
)
_NO_SOAP = "it is not SOAP (precondition_frequency is SOAP's eigenbasis refresh interval)"
_NORMS_ARE_ADAMWS = "the recipe's K-FAC takes the hidden Linear layers only; norms are AdamW's"
_RECIPE_NORMS = {"normalization": _NORMS_ARE_ADAMWS, "batchnorm": _NORMS_ARE_ADAMWS}


@dataclass(frozen=True)
class OptimizerRow:
    """One ``--optimizer`` value.

    Attributes:
        base: The optimizer that applies the update
            (:data:`spdkfac.training.optimizers.BASE_OPTIMIZERS`).
        kfac: Whether K-FAC preconditions it.
        hidden_only: K-FAC takes only the transformer recipe's hidden layers
            (:func:`spdkfac.training.optimizers.hidden_layers`); AdamW the rest.
        defaults: Flat-form values beyond ``TrainConfig``'s own field defaults.
        fixed: Flat option -> why only the row's value runs (recorded in ``config.toml``).
        unused: Flat option -> why it means nothing to this optimizer (fixed at the field
            default and left out of ``config.toml``; with :data:`KFAC_ONLY` for a row
            without K-FAC).
    """

    base: str
    kfac: bool = False
    hidden_only: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, str] = field(default_factory=dict)
    unused: Mapping[str, str] = field(default_factory=dict)

    def all_unused(self) -> Mapping[str, str]:
        """Every option that means nothing to this optimizer, with why."""
        return self.unused if self.kfac else {**dict.fromkeys(KFAC_ONLY, _NO_KFAC), **self.unused}

    def fixes(self) -> Mapping[str, str]:
        """Every option the row fixes (used at one value, or unused), with why."""
        return {**self.all_unused(), **self.fixed}

    def applies(self, name: str) -> bool:
        """Whether flat option ``name`` means anything for this optimizer (a run's
        ``config.toml`` leaves out those that do not)."""
        return name not in self.all_unused()


def _row(
    base: str,
    *,
    kfac: bool = False,
    hidden_only: bool = False,
    defaults: Mapping[str, Any] | None = None,
    fixed: Mapping[str, str] | None = None,
    unused: Mapping[str, str] | None = None,
) -> OptimizerRow:
    """A row with read-only mappings."""
    return OptimizerRow(
        base,
        kfac=kfac,
        hidden_only=hidden_only,
        defaults=MappingProxyType(dict(defaults or {})),
        fixed=MappingProxyType(dict(fixed or {})),
        unused=MappingProxyType(dict(unused or {})),
    )


#: torch.optim.AdamW's own defaults (lr, decoupled weight decay), and its beta1 as
#: ``momentum``: what an AdamW base runs.
_ADAMW = {"lr": 0.001, "weight_decay": 0.01}
_ADAMW_FIXED = {"momentum": _BETA1, "nesterov": _NO_NESTEROV}
_NOT_SOAP = {"precondition_frequency": _NO_SOAP}
_SGD_UNUSED = {"beta2": _NO_ADAMW, **_NOT_SOAP}
_KFAC_MUON = {
    "lr": 0.0108, "momentum": 0.95, "nesterov": True, "weight_decay": 0.00371,
    "inverse_method": "one-sided", "kl_clip": 0.0, "damping": 0.654,
    "factor_update_steps": 5, "inv_update_steps": 50,
}  # fmt: skip
_KFAC_EIGEN_ADAM = {
    "lr": 0.00229, "momentum": 0.0, "weight_decay": 0.00152, "inverse_method": "eigen-adam",
    "kl_clip": 0.0, "factor_update_steps": 10, "inv_update_steps": 10,
}  # fmt: skip

#: The study's text revision 4 (steps to a target, AlgoPerf's rules): the configuration of
#: kfac-eigen-adam-muon's best scored trial (its report: "Each row's best scored trial"), the K-FAC
#: form with the fewest steps to the target there; every AdamW part at beta2 0.95, no decay
#: on norms, biases and embeddings.
_KFAC_EIGEN_ADAM_MUON = {
    "lr": 0.0153, "momentum": 0.0, "weight_decay": 0.01, "beta2": 0.95,
    "decay_scope": "matrices",
    "inverse_method": "eigen-adam", "kl_clip": 0.0, "factor_update_steps": 2,
    "inv_update_steps": 2,
}  # fmt: skip

#: Every ``--optimizer``. SGD's values (lr 0.1, momentum 0.9, weight decay 5e-4) are
#: ``TrainConfig``'s field defaults, K-FAC's are ``KFACConfig``'s; AdamW, Muon and SOAP
#: take their library's defaults; kfac-muon and kfac-eigen-adam the configurations the
#: time-to-result study's text revision 3 chose for them (its report, "Chosen
#: configurations"; momentum 0.95 for Muon as its runs used), kfac-eigen-adam-muon its
#: text revision 4's.
OPTIMIZER_TABLE: Mapping[str, OptimizerRow] = MappingProxyType(
    {
        "sgd": _row("sgd", unused=_SGD_UNUSED),
        "kfac": _row("sgd", kfac=True, unused=_SGD_UNUSED),
        "adamw": _row("adamw", defaults=_ADAMW, fixed=_ADAMW_FIXED, unused=_NOT_SOAP),
        "kfac-adamw": _row(
            "adamw", kfac=True, defaults=_ADAMW, fixed=_ADAMW_FIXED, unused=_NOT_SOAP
        ),
        # torch.optim.Muon's defaults.
        "muon": _row(
            "muon",
            defaults={"lr": 0.001, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1},
            unused=_NOT_SOAP,
        ),
        # heavyball.SOAP's defaults (betas (0.9, 0.95)).
        "soap": _row(
            "soap",
            defaults={"lr": 0.003, "weight_decay": 0.01},
            fixed=_ADAMW_FIXED,
            unused={"beta2": "SOAP keeps heavyball's betas (0.9, 0.95)"},
        ),
        "kfac-muon": _row(
            "muon",
            kfac=True,
            hidden_only=True,
            defaults=_KFAC_MUON,
            fixed={"kl_clip": _MUON_SCALE, "grafting": _MUON_SCALE, **_RECIPE_NORMS},
            unused=_NOT_SOAP,
        ),
        "kfac-eigen-adam": _row(
            "eigen-adam",
            kfac=True,
            hidden_only=True,
            defaults=_KFAC_EIGEN_ADAM,
            fixed={
                "momentum": "the eigen-adam form keeps Adam's momentum (beta1 0.95) and the "
                "hidden layers step with momentum-free SGD",
                "nesterov": _NO_NESTEROV,
                "inverse_method": "it is the eigen-adam form (kfac, kfac-adamw or kfac-muon "
                "take another --inverse-method)",
                "kl_clip": _EIGEN_ADAM_SCALE,
                **_RECIPE_NORMS,
            },
            unused=_NOT_SOAP,
        ),
        "kfac-eigen-adam-muon": _row(
            "eigen-adam-muon",
            kfac=True,
            hidden_only=True,
            defaults=_KFAC_EIGEN_ADAM_MUON,
            fixed={
                "momentum": "the eigen-adam form keeps Adam's momentum (beta1 0.95) and "
                "Muon orthogonalizes its direction without momentum of its own",
                "nesterov": _NO_NESTEROV,
                "inverse_method": "it is the eigen-adam form then Muon (kfac-muon takes "
                "another --inverse-method)",
                "kl_clip": _MUON_SCALE,
                "grafting": _MUON_SCALE,
                **_RECIPE_NORMS,
            },
            unused=_NOT_SOAP,
        ),
    }
)


def optimizer_defaults(optimizer: object) -> dict[str, Any]:
    """The flat-form defaults of ``--optimizer`` ``optimizer`` beyond ``TrainConfig``'s
    field defaults (empty for an unknown name: the config's own check names it)."""
    row = OPTIMIZER_TABLE.get(optimizer) if isinstance(optimizer, str) else None
    return {} if row is None else dict(row.defaults)


def check_optimizer_options(
    optimizer: str, values: Mapping[str, Any], field_defaults: Mapping[str, Any]
) -> None:
    """Refuse a flat option ``optimizer``'s row fixes at another value than the row's.

    Args:
        optimizer: An ``--optimizer`` value (a key of :data:`OPTIMIZER_TABLE`).
        values: The run's flat options.
        field_defaults: ``TrainConfig``'s field defaults in the flat form.

    Raises:
        ValueError: Naming the first such option, its value, the optimizer and why.
    """
    row = OPTIMIZER_TABLE[optimizer]
    for name, why in row.fixes().items():
        expected = row.defaults.get(name, field_defaults.get(name))
        if name in values and values[name] != expected:
            runs = f" (it runs {name} {expected!r})" if row.applies(name) else ""
            raise ValueError(
                f"{name} {values[name]!r} does not apply to optimizer {optimizer!r}{runs}: {why}"
            )
