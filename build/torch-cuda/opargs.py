"""What the custom ops (the loss's ``ops.py``, the per-token ``tokens.py``, the divergence's
``divergence_ops.py``) take besides tensors, declared once per op and read back inside it:

- their float options (``Floats``): one CPU float64 tensor. A custom op's ``float`` argument makes
  ``torch.compile`` specialise on its value (a recompile per temperature of a schedule); a tensor
  argument does not, and it is read inside the op on the host (a CPU tensor: no device sync).
  Adding a float option is its name in the declaration and its use.
- their other options (``Args``): the op's own int / bool / str arguments, in one declared order
  that packs them, unpacks them in the autograd context and counts their gradients (None).
- the call's plan (``plan.Plan``, ``plan.DivergencePlan``), the one argument that picks the path:
  its mode as a string, the rest as one list of ints (a custom op takes no dataclass). The op, its
  fake implementation and its autograd context decode the same arguments; nothing re-derives it.
"""

import math

import torch

from .backward_passes import BackwardPlan
from .plan import DivergenceChunks, DivergencePlan, Plan

# The ops' namespace: the package's own module name, unique per build (the loader imports each build
# under its own id), so two builds can live in one process.
NAMESPACE = __name__.split(".")[0].lstrip("_") or "fused_linear_ce"


def float_tensor(values) -> torch.Tensor:
    """Floats as one CPU float64 tensor, traceable: under ``torch.compile`` they may be symbolic."""
    if not torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float64)
    # Traced: arithmetic on the (possibly symbolic) floats keeps them graph inputs.
    one = torch.ones((), dtype=torch.float64)
    return torch.stack([one * x for x in values])


class Floats:
    """An op's float options, by name in their order in its ``scalars`` tensor; None (an absent
    softcap) travels as NaN, which no validated option is."""

    def __init__(self, *names: str):
        self.names = names

    def tensor(self, source) -> torch.Tensor:
        """The tensor of ``source``'s values: a dict's items or an object's attributes of these names."""
        values = (source[name] if isinstance(source, dict) else getattr(source, name) for name in self.names)
        return float_tensor(tuple(math.nan if x is None else x for x in values))

    def read(self, scalars: torch.Tensor) -> dict:
        """{name: float, or None for NaN}, inside the op."""
        return {name: None if math.isnan(x) else x for name, x in zip(self.names, scalars.tolist())}


class Args:
    """An op's other options, by name in the order of its arguments (after its tensors and
    ``scalars``)."""

    def __init__(self, *names: str):
        self.names = names

    def pack(self, **values) -> list:
        """The arguments in order; every name given, no other."""
        assert set(values) == set(self.names), sorted(set(values) ^ set(self.names))
        return [values[name] for name in self.names]

    def unpack(self, values) -> dict:
        """{name: value} of the op's arguments as the autograd context gets them."""
        return dict(zip(self.names, values))

    @property
    def no_gradients(self) -> tuple:
        """What a backward returns for these arguments: None each."""
        return (None,) * len(self.names)


def fake_gradients(hidden, weight, bias, need_dx: bool, need_dw: bool, need_db: bool):
    """A recompute backward op's outputs for its fake implementation: grad_hidden, grad_weight,
    grad_bias in their leaves' shapes and dtypes where wanted, else empty (0,)."""
    empty = hidden.new_empty((0,))
    return (hidden.new_empty(hidden.shape) if need_dx else empty,
            weight.new_empty(weight.shape) if need_dw else empty,
            bias.new_empty(bias.shape) if need_db and bias is not None else empty)

# A pass's fields, in ``BackwardPlan``'s order, each an int.
_PASS_FIELDS = len(BackwardPlan.__dataclass_fields__)
# ``Plan.budget`` None.
_NO_BUDGET = -1


def encode(plan: Plan) -> list[int]:
    """The plan but its mode: [budget, rows, head_rows, slab_rows, borrowed, *each pass's fields]."""
    head = [_NO_BUDGET if plan.budget is None else plan.budget, plan.rows, plan.head_rows, plan.slab_rows,
            _int(plan.borrowed)]
    return head + [_int(x) for p in plan.passes for x in p.__dict__.values()]


def _int(x):
    """A bool as 0 / 1; an int as it is (under ``torch.compile`` it may be symbolic: ``int`` would
    specialise it)."""
    return int(x) if isinstance(x, bool) else x


def decode(mode: str, ints: list[int]) -> Plan:
    budget, rows, head_rows, slab_rows, borrowed, *rest = ints
    passes = tuple(BackwardPlan(*rest[i:i + 2], *(bool(x) for x in rest[i + 2:i + _PASS_FIELDS]))
                   for i in range(0, len(rest), _PASS_FIELDS))
    return Plan(mode, None if budget == _NO_BUDGET else budget, rows, head_rows, slab_rows, passes, bool(borrowed))


def encode_divergence(plan: DivergencePlan) -> list[int]:
    """[forward rows, group, own_da, backward rows, group, own_da] (the backward's 0 without one)."""
    back = plan.backward or DivergenceChunks(0, 0)
    return [plan.forward.rows, plan.forward.group, _int(plan.forward.own_da), back.rows, back.group, _int(back.own_da)]


def decode_divergence(mode: str, ints: list[int]) -> DivergencePlan:
    f_rows, f_group, f_own, b_rows, b_group, b_own = ints
    backward = DivergenceChunks(b_rows, b_group, bool(b_own)) if b_rows else None
    return DivergencePlan(mode, DivergenceChunks(f_rows, f_group, bool(f_own)), backward)
