"""What the driver needs to know about the configured model and loss, without weights."""
from __future__ import annotations

from typing import Any

from dta.config.loss import loss_kwargs
from dta.losses import make_loss
from dta.paths import check_path
from runtime.errors import TrainingError


def model_limits(cfg) -> tuple[int, int | None, Any]:
    """(vocab size, max positions, HF config) of the configured model."""
    if cfg.model.path:
        import transformers

        check_path(str(cfg.model.path), "dir", "model.path", error=TrainingError,
                   hint="a local Hugging Face model folder: DTA never downloads one")
        hf = transformers.AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    else:
        from dta.model.models import build_config

        hf = build_config(cfg.model.family, cfg.model.size)
    return int(hf.vocab_size), getattr(hf, "max_position_embeddings", None), hf


def required_fields(cfg) -> tuple[str, ...]:
    """Per-token fields a batch must carry (those the workers recompute excluded)."""
    from runtime.ray_runtime.worker import recompute_fields

    loss = make_loss(cfg.loss.name, **loss_kwargs(cfg))
    filled = recompute_fields(cfg, loss)
    return tuple(f for f in loss.fields if f not in filled)
