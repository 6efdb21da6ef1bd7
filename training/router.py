"""Router health of a mixture-of-experts model: each layer's share of tokens per expert, the
load-balancing loss, and a collapsed router as a guardrail finding.

transformers returns every MoE layer's router logits (`output_router_logits=True`) and the
load-balancing loss (`aux_loss`), but nothing watches them during training: a router that stops
sending tokens to an expert wastes its parameters silently, and the loss curve does not show it.
`RouterStats` counts each token's top-k experts per layer over an optimizer step, sums the counts
over ranks, and reports the shares; an expert under `share` of its layer's tokens for `steps`
optimizer steps in a row is a finding (`collapsed`).
"""

from __future__ import annotations

from typing import Any


class RouterStats:
    def __init__(self, top_k: int, share: float, steps: int):
        self.top_k, self.floor, self.patience = top_k, share, steps
        self.step_counts: Any = None  # [layers, experts] tokens routed in this optimizer step
        self.run_counts: Any = None  # ... over the whole run (this process's part of it)
        self.low: Any = None  # consecutive steps each expert spent under the floor
        self.aux_sum, self.aux_n = 0.0, 0
        self.reported: set[tuple[int, int]] = set()

    def add(self, router_logits: tuple[Any, ...], aux_loss: Any) -> None:
        """One micro-batch's router logits (one [tokens, experts] tensor per MoE layer) and its loss."""
        import torch

        with torch.no_grad():
            experts = router_logits[0].shape[-1]
            counts = torch.stack(
                [
                    torch.bincount(
                        torch.topk(logits.float(), self.top_k, dim=-1).indices.reshape(-1), minlength=experts
                    )
                    for logits in router_logits
                ]
            ).to("cpu", torch.float64)
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        self.aux_sum += float(aux_loss.detach())
        self.aux_n += 1

    def discard(self) -> None:
        """Forget the current step's counts (a step that was rolled back)."""
        self.step_counts, self.aux_sum, self.aux_n = None, 0.0, 0

    def close_step(self, all_reduce: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The step's metrics (summed over ranks by `all_reduce`, a function of a float64 tensor) and
        the experts that have just been under the floor for `steps` steps in a row."""
        import torch

        if self.step_counts is None:
            return {}, []
        packed = torch.cat([self.step_counts.reshape(-1), torch.tensor([self.aux_sum, float(self.aux_n)])])
        packed = all_reduce(packed)
        counts = packed[:-2].reshape(self.step_counts.shape)
        aux = float(packed[-2] / max(packed[-1], 1.0))
        self.run_counts = counts if self.run_counts is None else self.run_counts + counts
        self.step_counts, self.aux_sum, self.aux_n = None, 0.0, 0
        shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1.0)
        self.low = (shares < self.floor).long() * ((self.low if self.low is not None else 0) + 1)
        values = {"router_aux_loss": aux, "expert_share_min": float(shares.min())}
        for layer, row in enumerate(shares.tolist()):
            for expert, share in enumerate(row):
                values[f"expert_share/layer{layer}/expert{expert}"] = share
        collapsed = []
        for layer, expert in (self.low >= self.patience).nonzero().tolist():
            if (layer, expert) not in self.reported:
                self.reported.add((layer, expert))
                collapsed.append({"layer": layer, "expert": expert, "share": float(shares[layer, expert])})
        return values, collapsed

    def shares(self) -> list[list[float]]:
        """Each layer's share of tokens per expert over the whole run."""
        if self.run_counts is None:
            return []
        return (self.run_counts / self.run_counts.sum(dim=1, keepdim=True).clamp(min=1.0)).tolist()
