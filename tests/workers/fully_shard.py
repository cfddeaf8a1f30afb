"""Worker functions for tests/sharding/test_fully_shard.py: px.FullyShard against torch's own ``fully_shard`` program.

Each case trains a small pytorch/examples-shaped Transformer twice in the same 4 gloo workers: once as torch's
FSDP2 program writes it (``init_device_mesh``, ``fully_shard`` on each block and on the root, a meta-device build
with ``to_empty`` and ``reset_parameters``, ``MixedPrecisionPolicy``), once through ``px.wrap(...,
shard=px.FullyShard(...))``, on the same seeds and the same per-rank batches. What each run records (per-step
losses, the final parameters whole, placements, units, the dtype a block computes in) must match bit for bit.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

VOCAB, DIM, LAYERS, SEQ, BATCH, STEPS, SEED = 12, 8, 3, 7, 2, 4, 0


class Block(nn.Module):
    """A transformer block's feed-forward half, with its norm and residual: one FSDP unit each."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Transformer(nn.Module):
    """Token embedding, ``LAYERS`` blocks, a norm and the output layer; ``reset_parameters`` as in the example."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def reset_parameters(self) -> None:
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _policy(mp: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}


def _build(meta: bool) -> nn.Module:
    with torch.device("meta") if meta else contextlib.nullcontext():
        return Transformer()


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """STEPS steps on this rank's own batches (the same in both programs); what the test compares."""
    seen: list[str] = []
    hook = model.layers[0].up.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(
            1000 * step + px.rank()))
        opt.zero_grad()
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    hook.remove()
    from torch.distributed.fsdp import FSDPModule
    return {"losses": losses, "compute_dtype": seen[0],
            "full": torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]),
            "placements": sorted({str(tuple(p.placements)) for p in model.parameters()}),
            "mesh_dims": sorted({p.device_mesh.ndim for p in model.parameters()}),
            "units": [name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
            "grad_dtype": str(next(model.parameters()).grad.dtype)}


def torch_program(shape: list[int], meta: bool, mp: bool) -> dict[str, Any]:
    """torch's own FSDP2 program (pytorch/examples' distributed/FSDP2/example.py, on CPU): the oracle."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(SEED)
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = _build(meta)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **_policy(mp))
    fully_shard(model, mesh=mesh, **_policy(mp))
    if meta:
        model.to_empty(device="cpu")
        model.reset_parameters()
    first = model.emb.weight.to_local().detach().clone()
    return {**_train(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), "first": first}


def phalanx_program(group_size: int, meta: bool, mp: bool, units: str, seeds_apart: bool) -> dict[str, Any]:
    """The same program through px.wrap; ``seeds_apart``: every rank seeded differently (rank 0 as torch's)."""
    torch.manual_seed(SEED + (100 * px.rank() if seeds_apart else 0))
    model = _build(meta)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before px.wrap, as a phalanx user does
    chosen = Block if units == "class" else (lambda m: isinstance(m, Block))
    model, opt = px.wrap(model, opt, shard=px.FullyShard(group_size=group_size, units=chosen, **_policy(mp)))
    first = model.emb.weight.to_local().detach().clone()
    return {**_train(model, opt), "first": first}


CASES: dict[str, dict[str, Any]] = {
    # item 1 (meta), 3 (units by class), 4 (one group: a 1-D mesh)
    "meta": {"shape": [4], "meta": True, "mp": False, "units": "class", "seeds_apart": False},
    # item 2 (bf16 parameters, fp32 reduction), 3 (units by a function), 4
    "mixed": {"shape": [4], "meta": False, "mp": True, "units": "function", "seeds_apart": False},
    # HSDP 2 x 2 keeps its 2-D mesh; meta + mixed precision; ranks seeded apart still initialise alike
    "hsdp": {"shape": [2, 2], "meta": True, "mp": True, "units": "class", "seeds_apart": True},
}


def oracles(cases: list[str]) -> dict[str, Any]:
    """Each case of ``cases``: torch's program, then phalanx's, in one start of the workers."""
    px.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in cases:
        c = CASES[name]
        out[name] = {"torch": torch_program(c["shape"], c["meta"], c["mp"]),
                     "phalanx": phalanx_program(c["shape"][-1], c["meta"], c["mp"], c["units"], c["seeds_apart"])}
    return out
