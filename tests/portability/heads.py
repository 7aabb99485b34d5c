"""Attention that reshapes with its stored head count, and a script that plans it at tp=2."""

import torch
import torch.nn.functional as F
from torch import nn


class HardCodedHeads(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, self.heads, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.hd))


class LiteralHeads(HardCodedHeads):
    """Unflattens by a literal head count: no attribute holds it, and no view fix reaches it."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).unflatten(-1, (8, self.hd)).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


if __name__ == "__main__":
    import shardplan

    # 8 literal heads: nothing can be made local, so the block runs whole
    with torch.device("meta"):
        model = nn.Sequential(LiteralHeads(dim=64, heads=8), nn.LayerNorm(64))
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, 64, device="meta"),), explain=False)
    print("\n".join(plan.warnings))


class HardCodedLM(nn.Module):
    """Token ids in, logits out, around two blocks of HardCodedHeads (4 heads of 16)."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(HardCodedHeads(dim, heads) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block, norm in zip(self.blocks, self.norms):
            x = x + block(norm(x))
        return self.head(x)


def hard_coded_lm() -> HardCodedLM:
    torch.manual_seed(0)
    return HardCodedLM()


class DerivedHeads(nn.Module):
    """Width and head count stored, head_dim derived in forward: halving ``dim`` alone also
    runs (4 heads of 8 instead of 2 of 16), so only {dim, heads} together is right."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, self.heads, self.dim // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, self.dim))


class DerivedLM(HardCodedLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DerivedHeads() for _ in range(2))


def derived_lm() -> DerivedLM:
    torch.manual_seed(0)
    return DerivedLM()


def hard_coded_lm_8_heads() -> HardCodedLM:
    """8 heads of 8: the head count equals head_dim."""
    return HardCodedLM(heads=8)


class SequenceMinusOneHeads(HardCodedHeads):
    """OPT's view (and older BART-family code's): ``-1`` on the sequence dim, the head count stored.
    On a shard the global count still runs, the ``-1`` absorbing the split."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, -1, self.heads, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def sequence_minus_one_lm() -> HardCodedLM:
    torch.manual_seed(0)
    model = HardCodedLM()
    for block in model.blocks:
        block.__class__ = SequenceMinusOneHeads
    return model
