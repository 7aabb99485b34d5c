"""Expert banks as code outside the project writes them, for verify's ``module:callable`` specs."""

import torch
from torch import nn


class Interleaved(nn.Module):
    """An expert bank in the bmm layout with biases, gate and up interleaved ([g0, u0, ...])."""

    def __init__(self, experts: int = 4, hidden: int = 16, inner: int = 8) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * inner) / hidden**0.5)
        self.w_in_bias = nn.Parameter(torch.randn(experts, 2 * inner))
        self.w_out = nn.Parameter(torch.randn(experts, inner, hidden) / inner**0.5)
        self.w_out_bias = nn.Parameter(torch.randn(experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("th,ehi->eti", x, self.w_in) + self.w_in_bias[:, None]
        h = torch.sigmoid(h[..., ::2]) * h[..., 1::2]
        return (torch.einsum("eti,eih->eth", h, self.w_out) + self.w_out_bias[:, None]).sum(0)


class InterleavedMoE(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.experts = Interleaved(hidden=hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, h = x.shape
        return self.head(self.experts(x.reshape(b * s, h)).reshape(b, s, h))


def interleaved_moe() -> InterleavedMoE:
    torch.manual_seed(0)
    return InterleavedMoE()


def gpt_oss_with_biases() -> nn.Module:
    """Tiny gpt-oss whose expert biases are random: its own init sets them to zero, and a
    zero bias cannot tell bias / tp per rank from bias on every rank."""
    from shardplan.interop.hf_models import build_hf_model

    model = build_hf_model("gpt_oss", tiny=True, device=torch.get_default_device())[0]
    if not next(model.parameters()).is_meta:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias") and ".experts." in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
    return model
