"""Weight modules outside the repeated blocks written the way libraries write them."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class LocalEmbedding(nn.Embedding):
    """torchtitan 0.3.0's Embedding: reads its weight's local tensor in its own forward."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return F.embedding(tokens, weight)


class FunctionalEmbedding(nn.Embedding):
    """An Embedding subclass that calls ``F.embedding`` with its weight and padding row."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight, self.padding_idx) * 2.0


class GlobalViewEmbedding(nn.Embedding):
    """Views its table by its global row count: no shard of it can run this forward."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return F.embedding(tokens, weight.view(self.num_embeddings, self.embedding_dim))


EMBEDDINGS = {"local": LocalEmbedding, "functional": FunctionalEmbedding, "global_view": GlobalViewEmbedding}


class TiedHead:
    """torchtune's TiedLinear: a plain object (not a module) computing with another
    module's weight."""

    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.owner.weight)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LocalEmbeddingLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, tied: bool = False,
                 embedding: str = "local") -> None:
        super().__init__()
        # the padding row (100) lies in the second rank's half of the table at tp=2
        self.embed = EMBEDDINGS[embedding](vocab, dim, **({"padding_idx": 100} if embedding == "functional" else {}))
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.tied = TiedHead(self.embed) if tied else None
        self.head = None if tied else nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.tied(x) if self.tied is not None else self.head(x)


def local_embedding_lm() -> LocalEmbeddingLM:
    torch.manual_seed(0)
    return LocalEmbeddingLM()


def functional_embedding_lm() -> LocalEmbeddingLM:
    torch.manual_seed(0)
    return LocalEmbeddingLM(embedding="functional")


def tied_lm() -> LocalEmbeddingLM:
    torch.manual_seed(0)
    model = LocalEmbeddingLM(tied=True)
    model.embed.__class__ = nn.Embedding  # the stock class: its style would run it on DTensors
    return model


class SharedTable(nn.Module):
    """One embedding registered under two names (an encoder-decoder with tied token tables, as
    x-transformers' ``tie_token_emb`` writes it), and a ``max_seq_len`` kept on the model."""

    def __init__(self, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.max_seq_len = 32
        self.encoder = nn.ModuleDict({"emb": nn.Embedding(vocab, dim), "up": nn.Linear(dim, 4 * dim),
                                      "down": nn.Linear(4 * dim, dim)})
        self.decoder = nn.ModuleDict({"emb": self.encoder["emb"], "up": nn.Linear(dim, 4 * dim),
                                      "down": nn.Linear(4 * dim, dim)})
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert tokens.shape[1] <= self.max_seq_len, "longer than the position table"
        memory = self.encoder["down"](F.gelu(self.encoder["up"](self.encoder["emb"](tokens))))
        x = self.decoder["emb"](tokens) + memory
        return self.head(x + self.decoder["down"](F.gelu(self.decoder["up"](x))))


def shared_table() -> SharedTable:
    torch.manual_seed(0)
    return SharedTable()


class WeightNormMLP(nn.Module):
    """An MLP of ``torch.nn.utils.parametrizations.weight_norm`` Linears (as WaveNet-style
    and GAN code write them): each weight is computed from ``original0`` (g) and
    ``original1`` (v) by a ParametrizationList, whose ``_weight_norm`` DTensor has no
    backward rule for."""

    def __init__(self, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm

        self.emb = nn.Embedding(vocab, dim)
        self.up, self.down = weight_norm(nn.Linear(dim, 4 * dim)), weight_norm(nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h + self.down(F.gelu(self.up(h))))


def weight_norm_mlp() -> WeightNormMLP:
    torch.manual_seed(0)
    return WeightNormMLP()


class StatefulMixer(nn.Module):
    """A gate with a parameter of its own that keeps its last output as a plain attribute, as
    recurrent layers keep their state (RecurrentGemma's ``self.recurrent_states``): the
    tracer runs it for its shapes, and it is left holding a tensor autograd made, which
    ``copy.deepcopy`` refuses."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.full((dim,), 0.5))
        self.state = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = x * torch.sigmoid(self.decay)
        return self.state


class StatefulLM(nn.Module):
    def __init__(self, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.mixer = StatefulMixer(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.down(F.gelu(self.up(self.mixer(x))))
        return self.head(x)
