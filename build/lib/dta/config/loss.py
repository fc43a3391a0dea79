"""The run config's loss section as the keyword arguments of ``dta.losses.make_loss``."""
from __future__ import annotations

from typing import Any


def loss_kwargs(cfg) -> dict[str, Any]:
    """Keyword arguments of ``dta.losses.make_loss`` for the configured loss."""
    lc = cfg.loss
    if lc.name == "nll":
        return {}
    return dict(eps_clip=float(lc.eps_clip),
                eps_clip_high=None if lc.eps_clip_high is None else float(lc.eps_clip_high),
                dual_clip=None if lc.dual_clip is None else float(lc.dual_clip),
                decoupled=bool(lc.decoupled),
                behav_imp_weight_cap=(None if lc.behav_imp_weight_cap is None
                                      else float(lc.behav_imp_weight_cap)),
                entropy_coef=float(lc.entropy_coef))
