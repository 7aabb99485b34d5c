"""Models whose inputs ``plan_model`` cannot infer: a ViT that starts with a Conv2d patch
embedding (images in), and an encoder-decoder whose forward takes two inputs. Their callables
return ``(model, example_inputs)``, as the CLI's ``module:callable`` allows."""

import torch
from torch import nn

from tests.portability.torch_attention import SelfAttention
from tests.portability.lm import PreNormBlock


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64, patch: int = 8, image: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.ModuleList(PreNormBlock(SelfAttention(dim, 8), dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def vit() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT()


def vit_with_inputs() -> tuple[TinyViT, torch.Tensor]:
    return vit(), torch.randn(2, 3, 32, 32)


class TwoInputs(nn.Module):
    def __init__(self, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, 8, 1, 1, 4 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head(self.transformer(self.embed(source), self.embed(target)))


def two_inputs() -> TwoInputs:
    torch.manual_seed(0)
    return TwoInputs()


def two_inputs_with_inputs() -> tuple[TwoInputs, tuple[torch.Tensor, torch.Tensor]]:
    return two_inputs(), (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
