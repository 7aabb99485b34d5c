"""Token scatter: a module's partial sums over tokens it flattened itself, reduce-scattered onto sequence shards.

Contract
--------
``TokenScatter(tokens_of=i, output_index=j, num_outputs=n)`` is applied by
``parallelize_module`` on a module that receives ``[b, s, ...]`` (argument ``tokens_of``,
gathered whole on entry) and returns its tokens flattened, ``[b * s, ...]``, as partial sums
over the ranks (element ``output_index`` of ``num_outputs``, or the one output). Each rank
gets its own sequence shard of every row, flattened as its ``[b, s / tp, ...]`` is:

    out [b * s, h] (Partial)  --view-->  [b, s, h]  --reduce-scatter dim 1-->  [b, s / tp, h]
                                                                 --view-->  [b * s / tp, h]

so the caller's ``out.view(residual.shape)`` (Llama 4's decoder layer) gives ``Shard(1)`` of
the residual stream. In the global ``[b * s, h]`` that is ``_StridedShard(0,
split_factor=b)``; ``b`` is the batch of the call, read off the argument at run time, so the
plan holds at any batch size and length. Backward all-gathers the gradient along the
sequence (the redistribute's own backward).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = ["TokenScatter"]


class TokenScatter(ParallelStyle):
    def __init__(self, *, tokens_of: int | str, output_index: int | None = None, num_outputs: int | None = None) -> None:
        super().__init__()
        self.tokens_of, self.output_index, self.num_outputs = tokens_of, output_index, num_outputs

    def _tokens(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        x = args[self.tokens_of] if isinstance(self.tokens_of, int) else kwargs[self.tokens_of]
        return x.shape[0], x.shape[1]  # a DTensor's shape is global

    def _scatter(self, out: Any, b: int, s: int, device_mesh) -> Any:
        local = out.to_local() if isinstance(out, DTensor) else out
        if local.shape[0] != b * s:
            raise ValueError(f"the module returned {local.shape[0]} rows where its input holds {b} x {s} tokens; the "
                             "plan expected its tokens flattened ([b * s, ...]): plan again for this model")
        rest = tuple(local.shape[1:])
        summed = DTensor.from_local(local.reshape(b, s, *rest), device_mesh, [Partial()], run_check=False)
        return summed.redistribute(device_mesh, [Shard(1)]).to_local().reshape(-1, *rest)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(mod, args, kwargs, output):
            b, s = self._tokens(args, kwargs)
            if self.output_index is None:
                return self._scatter(output, b, s, device_mesh)
            items = list(output)
            items[self.output_index] = self._scatter(items[self.output_index], b, s, device_mesh)
            return type(output)(items)

        module.register_forward_hook(hook, with_kwargs=True)
        return module
