"""Which parameters of a CausalQwen model train (docs/design.md §7): the frozen backbone, abduction-only fine-tuning."""

from __future__ import annotations

import copy

__all__ = ["apply_freeze_backbone", "enable_abduction_finetuning"]


def apply_freeze_backbone(model) -> None:
    """Set `requires_grad` of the backbone from `config.freeze_backbone`, and keep any anchor frozen."""
    model.model.requires_grad_(not model.config.freeze_backbone)
    if model.abduction_anchor is not None:
        model.abduction_anchor.requires_grad_(False)


def enable_abduction_finetuning(model, anchor_weight: float = 1.0, reset_anchor: bool = False) -> None:
    """Train the abduction network of `model` only, anchored to where it starts.

    Every parameter but `abduction.loc_net` and `abduction.scale_net` is frozen; a frozen copy of the current
    abduction network becomes `abduction_anchor`, and the loss gains `anchor_weight` times the mean over labelled
    positions of Σ_c KL(Cauchy(loc_U, scale_U) ‖ Cauchy(loc_U⁰, scale_U⁰)), which is 0 at the start and keeps U close
    to the base abduction (a guard against forgetting when adapting to a new domain). An anchor the model already
    has (e.g. loaded with a checkpoint saved mid-way) is kept unless `reset_anchor=True`.
    """
    if not anchor_weight >= 0:
        raise ValueError(f"anchor_weight must be a non-negative number, got {anchor_weight}")
    model.requires_grad_(False)
    model.abduction.requires_grad_(True)
    if model.abduction.context_values is not None:  # started and refitted from data, not trained (§1b)
        model.abduction.context_values.requires_grad_(False)
    if anchor_weight == 0:
        model.abduction_anchor = None
    elif model.abduction_anchor is None or reset_anchor:
        # The copy shares the model's config (the memo), so that it follows later edits of scale_min.
        model.abduction_anchor = copy.deepcopy(model.abduction, {id(model.config): model.config}).requires_grad_(False)
    model.config.abduction_anchor_weight = float(anchor_weight)
